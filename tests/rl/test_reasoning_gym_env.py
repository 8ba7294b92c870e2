"""The reasoning_gym environment: single-turn reasoning-gym items (skipped without the extra).

Determinism, the dataset's own checker (oracle 1, wrong answers below 1), the level ->
difficulty mapping of basic_arithmetic, one-line errors (unknown dataset, missing package),
oracle SFT demos, and one short rollout on the smallest hybrid with forced oracle answers.
"""

import re
import sys

import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.infer import Engine, SamplingConfig
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.envs import Answer, Malformed, make_env
from hybridmoe_jax.rl.envs import reasoning_gym as rg_env
from hybridmoe_jax.rl.episode import EpisodeSpec, oracle_script
from hybridmoe_jax.rl.rollout import Rollout, RolloutConfig
from hybridmoe_jax.rl.sft import oracle_demos
from tests._support import tiny_model_config


@pytest.fixture
def needs_reasoning_gym():
  """Skips a test without the optional package (the missing-package test runs anyway)."""
  pytest.importorskip("reasoning_gym", reason="reasoning-gym is an optional extra: "
                      'pip install -e ".[reasoning-gym]"')


TOK = ByteTokenizer(chat=True)
_NUMBER = re.compile(r"\d+")


def _solve(env, seed, level):
  env.reset(seed, level)
  (answer,) = env.oracle()
  return answer, env.step(answer)


@pytest.mark.usefixtures("needs_reasoning_gym")
def test_episodes_are_deterministic_and_single_turn():
  a, b = make_env("reasoning_gym"), make_env("reasoning_gym", dataset="basic_arithmetic")
  obs = a.reset(11, 2)
  assert obs == b.reset(11, 2) and a.oracle() == b.oracle()
  assert obs.prompt.startswith("Calculate ") and obs.tools == ()
  assert (obs.horizon, obs.max_turns, a.max_level) == (0, 1, 4)
  assert a.reset(12, 2).prompt != obs.prompt and a.reset(11, 3).prompt != obs.prompt
  # brief prompts are the question itself
  assert make_env("reasoning_gym", brief=True).reset(11, 2).prompt == obs.prompt


@pytest.mark.usefixtures("needs_reasoning_gym")
def test_the_dataset_checker_scores_the_oracle_one_and_wrong_answers_less():
  env = make_env("reasoning_gym")
  for seed, level in [(0, 0), (1, 2), (2, 4)]:
    answer, r = _solve(env, seed, level)
    assert (r.done, r.reward, r.finish_reason) == (True, 1.0, "answer"), r
    assert r.info["target"] == answer.text
    env.reset(seed, level)
    assert env.step(Answer(f" {answer.text}\n")).reward == 1.0      # stripped
    env.reset(seed, level)
    assert env.step(Answer(str(int(answer.text) + 1))).reward == 0.0
  # basic_arithmetic's checker gives partial credit for the target inside a longer text
  env.reset(2, 4)
  partial = env.step(Answer(f"x = {answer.text}")).reward
  assert 0.0 < partial < 1.0
  # one turn only: an unparsable turn ends the episode with reward 0
  env.reset(3, 1)
  r = env.step(Malformed("no <answer>"))
  assert (r.done, r.reward, r.finish_reason) == (True, 0.0, "max_turns")


@pytest.mark.usefixtures("needs_reasoning_gym")
def test_levels_map_to_basic_arithmetic_difficulty():
  env = make_env("reasoning_gym")
  level0 = [_NUMBER.findall(env.reset(s, 0).prompt) for s in range(8)]
  assert all(len(n) == 2 and all(len(x) == 1 for x in n) for n in level0), level0
  level4 = [_NUMBER.findall(env.reset(s, 4).prompt) for s in range(8)]
  assert max(len(n) for n in level4) > 2 and max(len(x) for n in level4 for x in n) > 1
  configs = rg_env.level_configs("basic_arithmetic")
  assert [(c["max_terms"], c["max_digits"]) for c in configs] == [(2, 1), (3, 2), (4, 3),
                                                                  (5, 4), (6, 4)]
  with pytest.raises(ValueError, match=r"reasoning_gym: level = 5: allowed an int in \[0, 4\]"):
    env.reset(0, 5)
  # a dataset without a curriculum: level 0 only, its default config
  assert make_env("reasoning_gym", dataset="gsm_symbolic").max_level == 0


@pytest.mark.usefixtures("needs_reasoning_gym")
def test_bad_dataset_name_is_one_line():
  with pytest.raises(ValueError, match=r"dataset = 'basic_arithmatic': allowed a "
                     r"reasoning-gym dataset \(\d+\), e\.g\. ab, ") as e:
    make_env("reasoning_gym", dataset="basic_arithmatic")
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="dataset = 3"):
    make_env("reasoning_gym", dataset=3)


def test_missing_package_names_the_extra(monkeypatch):
  # Runs with or without the package: a None entry makes `import reasoning_gym` fail.
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)
  with pytest.raises(ImportError, match=re.escape('pip install -e ".[reasoning-gym]"')) as e:
    make_env("reasoning_gym")
  assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


@pytest.mark.usefixtures("needs_reasoning_gym")
def test_oracle_demos_render():
  demos = oracle_demos("reasoning_gym", TOK, level=1, seeds=[0, 1])
  for d in demos:
    roles = [m.role for m in d.messages]
    assert roles == ["system", "user", "assistant"] and d.reward == 1.0
    np.testing.assert_array_equal(chat_format.render(TOK, d.messages).ids, d.ids)
    body = TOK.decode(d.ids[d.assistant_mask == 1][:-1])     # the answer, before <end_turn>
    assert body == d.messages[-1].action.text


@pytest.mark.usefixtures("needs_reasoning_gym")
def test_short_rollout_with_forced_oracle_answers():
  # One MLA layer, built under one jit (eager init compiles op by op): the env is the claim.
  cfg = tiny_model_config(num_layers=1, layer_kinds=("mla",), vocab_size=TOK.vocab_size)
  model = nnx.jit(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))()
  engine = Engine(model, max_len=128, prefill_chunk=64, kv_block=64)
  rollout = Rollout(engine, TOK, RolloutConfig(max_tokens=128, max_turn_tokens=16, max_turns=2,
                                               sampling=SamplingConfig(temperature=1.0)),
                    batch=2)
  brief = (("brief", True),)
  e0, e1 = (EpisodeSpec("reasoning_gym", s, 1, group=s, sample_seed=s, env_kwargs=brief)
            for s in (0, 1))
  specs = [EpisodeSpec(**{**e0.__dict__, "forced": oracle_script(e0)}), e1]
  oracle, free = rollout.run(specs).finished
  assert (oracle.reward, oracle.finish_reason, oracle.num_turns) == (1.0, "answer", 1)
  assert oracle.forced.sum() == oracle.loss_mask.sum() > 0
  np.testing.assert_array_equal(chat_format.render(TOK, oracle.messages).ids, oracle.ids)
  # a free turn of an untrained model: one turn, then the episode is over
  assert free.num_turns == 1 and free.reward < 1.0 and free.forced.sum() == 0
