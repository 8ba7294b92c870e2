"""Agent evaluation: held-out seeds, the three policies on one tiny trained run (oracle
must score 1.0 on arithmetic and retrieval, the model's numbers are well formed, random
runs), agent.json / agent_success.png as run_eval.py --task=agent writes them, readable
trajectory records through JSON and JSONL, and bad input failing before compute.

One run serves the file: 1 train step of the 2-layer MLA model over the chat byte
tokenizer (data.tokenizer = "byte_chat"), evaluated in process by the function
run_eval.py calls; the trained and the "random" model share one graph, so the rollout
compiles its shapes once.
"""

import dataclasses
import json
import types

import numpy as np
import pytest

from hybridmoe_jax.tools import agent_eval
from hybridmoe_jax.tools.agent_eval import AgentOptions, options_from_flags, resolve_envs
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.envs import Answer
from hybridmoe_jax.rl.episode import EpisodeSpec, Trajectory
from hybridmoe_jax.rl.run_state import HostState
from hybridmoe_jax.rl.evaluate import (EVAL_SEED_HI, EVAL_SEED_LO, evaluate_agent,
                                       eval_seeds)
from hybridmoe_jax.rl.trajectory_log import (decode_with_specials, trajectory_record,
                                             write_trajectories)
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests.conftest import load_config, one_device
from tests._support import format_record, read_trajectories, set_tiny_model
from tests.train.train_fakes import FakeIterator

TOK = ByteTokenizer(chat=True)
ENVS = ("arithmetic", "retrieval")
OPTIONS = AgentOptions(envs=ENVS, levels=(0,), episodes=2, brief=True, max_tokens=512,
                       max_turn_tokens=32, batch=4, prefill_chunk=128, kv_block=128,
                       feed_width=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(workdir of a 1-step byte_chat run, run_agent_eval's return, its printed lines)."""
  root = tmp_path_factory.mktemp("agent")
  config = load_config("tiny")
  set_tiny_model(config)
  config.model.moe.latent_dim = 8
  config.model.vocab_size = TOK.vocab_size
  config.data.tokenizer = "byte_chat"
  config.train.update(dict(steps=1, batch_size=2, seq_len=16, warmup=1, log_every=1,
                           eval_every=0, eval_batches=1, checkpoint_every=0, heatmap_every=0,
                           async_checkpoints=False))
  # No held-out batches: the run's final evaluation then compiles nothing.
  data = types.SimpleNamespace(train=FakeIterator(2, 16), eval_batches=[])
  with one_device():
    train_and_evaluate(run_config_from_dict(config), str(root / "w"), data=data)
  lines = []
  out = agent_eval.run_agent_eval(workdir=str(root / "w"), params=None,
                                  output_dir=str(root / "eval"), options=OPTIONS,
                                  echo=lines.append)
  return str(root / "w"), out, lines


def test_policies_on_a_trained_run(run):
  _, out, lines = run
  results = out["results"]
  assert list(results) == ["model", "oracle", "random"]
  assert out["envs"] == {"arithmetic": {"brief": True}, "retrieval": {"brief": True}}
  # The oracle's forced actions solve every held-out task: the pipeline is sound.
  oracle = results["oracle"]
  assert [(c["env"], c["level"], c["success_rate"]) for c in oracle["cells"]] == [
      ("arithmetic", 0, 1.0), ("retrieval", 0, 1.0)]
  assert oracle["overall"] == {"episodes": 4, "success_rate": 1.0, "mean_reward": 1.0}
  for c in oracle["cells"]:
    assert c["finish_reasons"] == {"answer": 2} and c["mean_turns"] == 2.0
  for policy, r in results.items():
    assert r["policy"] == policy and r["episodes"] == 2
    assert r["temperature"] == {"model": 0.0, "oracle": 0.0, "random": 1.0}[policy]
    for c, o in zip(r["cells"], oracle["cells"]):
      assert c["seeds"] == o["seeds"]                      # the same tasks for every policy
      assert all(EVAL_SEED_LO <= s < EVAL_SEED_HI for s in c["seeds"])
      assert 0.0 <= c["success_rate"] <= c["mean_reward"] <= 1.0
      assert sum(c["finish_reasons"].values()) == c["episodes"] == 2
      assert 1.0 <= c["mean_turns"] <= 4.0 and c["mean_generated_tokens"] > 0
      assert c["mean_total_tokens"] <= OPTIONS.max_tokens
      assert 1 <= len(c["examples"]) <= 2
  # An untrained model does not produce oracle answers on these tasks.
  assert results["random"]["overall"]["success_rate"] < 1.0
  table = lines[-2]
  assert table.splitlines()[0].split()[:4] == ["env", "level", "policy", "success"]
  assert len(table.splitlines()) == 1 + 2 * 3


def test_agent_json_and_figure(run):
  workdir, out, _ = run
  with open(out["json"], encoding="utf-8") as f:
    saved = json.load(f)
  assert saved["task"] == "agent" and saved["model"]["step"] == 1
  assert saved["options"]["envs"] == list(ENVS) and saved["options"]["brief"] is True
  assert saved["results"] == json.loads(json.dumps(out["results"]))
  record = saved["results"]["oracle"]["cells"][0]["examples"][0]
  assistant = [t for t in record["turns"] if t["role"] == "assistant"]
  assert [t["action"] for t in assistant] == ["tool_call", "answer"]
  call = assistant[0]
  assert call["text"] == f"<tool_call>calculator {call['argument']}<end_turn>"
  assert call["tokens"] == call["forced_tokens"] == len(f"calculator {call['argument']}") + 2
  assert isinstance(call["mean_logp"], float) and call["mean_logp"] < 0
  assert [t["role"] for t in record["turns"]] == ["system", "user", "assistant",
                                                  "tool_result", "assistant"]
  assert record["reward"] == 1.0 and record["finish_reason"] == "answer"
  from matplotlib import image as mpimg   # pylint: disable=g-import-not-at-top
  assert mpimg.imread(out["figure"]).shape[2] in (3, 4)
  assert out["json"] == str(workdir).rsplit("/", 1)[0] + "/eval/agent.json"


def _trajectory():
  """A hand-made finished Trajectory: a sampled turn with stray bytes and a cut UTF-8
  character (ids as sampled), a tool result, a forced answer."""
  roles = chat_format.chat_ids(TOK)
  sampled = (104, 105, 0xE2, 0x82, roles["tool_call"], *b"calculator 2 + 2",
             roles["end_turn"])
  messages = [chat_format.Message("system", "Tools: calculator"),
              chat_format.Message("user", "x0 = 2\nx1 = x0 + 2\nx1?"),
              chat_format.parse_message(TOK, sampled),
              chat_format.Message("tool_result", "4"),
              chat_format.Message("assistant", action=Answer("4"))]
  r = chat_format.render(TOK, messages)
  n = len(r.ids)
  logp = np.where(r.assistant_mask == 1, -np.linspace(0.5, 1.5, n), 0).astype(np.float32)
  forced = (r.assistant_mask * (r.turn_index == 4)).astype(np.int32)
  spec = EpisodeSpec("arithmetic", 7, 0, group=3, sample_seed=9)
  return Trajectory(spec, r.ids, r.assistant_mask, forced, logp, logp, r.turn_index,
                    tuple(messages), 1.0, "answer", 2, int(np.argmax(r.assistant_mask)),
                    {"turn": 2, "target": np.int64(4), "ratio": float("nan")}), sampled


def test_open_groups_trajectories_survive_a_checkpoint(tmp_path):
  """A trajectory waiting for the rest of its group is saved with the step and comes back
  whole: its spec and messages as objects (a plain-dict spec would break `.group`)."""
  traj, _ = _trajectory()
  traj = dataclasses.replace(traj, spec=dataclasses.replace(
      traj.spec, forced=(None, Answer("4"), (5, 6))))
  state = HostState(waiting=[traj])
  state.save_episodes(str(tmp_path), 3)
  back = HostState.restore(str(tmp_path), 3, state.record()).waiting[0]
  assert back.group == 3 and back.spec == traj.spec and back.messages == traj.messages
  for field in ("ids", "loss_mask", "forced", "logp", "sample_logp", "turn_index"):
    np.testing.assert_array_equal(getattr(back, field), getattr(traj, field))
  assert (back.reward, back.finish_reason, back.num_turns, back.prompt_len) == (
      traj.reward, traj.finish_reason, traj.num_turns, traj.prompt_len)


def test_trajectory_record_round_trips_and_shows_sampled_text(tmp_path):
  traj, sampled = _trajectory()
  rec = trajectory_record(traj, TOK)
  assert json.loads(json.dumps(rec, allow_nan=False)) == rec
  assert (rec["env"], rec["level"], rec["seed"], rec["group"], rec["reward"]) == (
      "arithmetic", 0, 7, 3, 1.0)
  assert rec["total_tokens"] == len(traj.ids) and rec["generated_tokens"] == traj.generated
  assert rec["info"] == {"turn": 2, "target": 4, "ratio": "nan"}
  first, _, answer = rec["turns"][2:]
  # The sampled ids, decoded as sampled: the cut character shows as U+FFFD, roles by name.
  assert first["text"] == "hi\ufffd<tool_call>calculator 2 + 2<end_turn>"
  assert first["text"] == decode_with_specials(TOK, sampled)
  assert (first["action"], first["tool"], first["argument"]) == ("tool_call", "calculator",
                                                                 "2 + 2")
  assert first["tokens"] == len(sampled) and first["forced_tokens"] == 0
  at = (traj.turn_index == 2) & (traj.loss_mask == 1)
  np.testing.assert_allclose(first["mean_logp"], traj.logp[at].mean(), rtol=1e-6)
  assert answer["text"] == "<answer>4<end_turn>" and answer["forced_tokens"] == 3
  assert decode_with_specials(TOK, [300]) == "<id 300>"
  path = str(tmp_path / "logs" / "traj.jsonl")
  assert write_trajectories(path, [rec]) == 1
  assert write_trajectories(path, [rec, rec]) == 2             # appended, not overwritten
  assert read_trajectories(path) == [rec] * 3
  with open(path, "a", encoding="utf-8") as f:
    f.write('{"cut": ')                                         # a run killed mid-write
  assert len(read_trajectories(path)) == 3
  text = format_record(rec)
  assert text.splitlines()[0].startswith("arithmetic level 0 seed 7: reward 1 (answer)")
  assert f"[tool_call, {len(sampled)} tokens, mean logp" in text and "3 forced" in text


def test_eval_seeds_are_held_out_and_fixed():
  a = eval_seeds(0, "arithmetic", 1, 16)
  assert a == eval_seeds(0, "arithmetic", 1, 16) and len(set(a)) == 16
  assert all(2**40 <= s < 2**41 for s in a)
  assert a[:4] == eval_seeds(0, "arithmetic", 1, 4)          # more episodes extend the list
  assert not set(a) & set(eval_seeds(0, "arithmetic", 2, 16))
  assert not set(a) & set(eval_seeds(0, "retrieval", 1, 16))
  assert not set(a) & set(eval_seeds(1, "arithmetic", 1, 16))


def test_envs_and_brief_from_the_run_config():
  saved = {"rl": {"envs": {"retrieval": {"start_level": 0, "max_level": 4, "weight": 1.0,
                                         "kwargs": {"brief": True, "base_lines": 8}},
                           "code": {"weight": 0.5}}}}
  assert resolve_envs(AgentOptions(), saved) == {"retrieval": {"brief": True,
                                                               "base_lines": 8}, "code": {}}
  assert resolve_envs(AgentOptions(brief=False), saved)["retrieval"] == {
      "brief": False, "base_lines": 8}
  assert resolve_envs(AgentOptions(envs=("arithmetic",)), saved) == {"arithmetic": {}}
  for odd in (None, {}, {"rl": None}, {"rl": {"envs": []}}, {"rl": {"envs": {"x": 3}}}):
    want = {"x": {}} if odd == {"rl": {"envs": {"x": 3}}} else {"arithmetic": {}}
    assert resolve_envs(AgentOptions(), odd) == want


def test_bad_input_fails_before_compute(tmp_path):
  kw = dict(envs={"arithmetic": {}}, levels={"arithmetic": [0]}, episodes=1, seed=0)
  model = object()                   # never touched: every check comes first
  for bad, match in [(dict(policy="greedy"), "policy = 'greedy'"),
                     (dict(episodes=0), r"episodes = 0: allowed an int >= 1"),
                     (dict(seed=-1), r"seed = -1"),
                     (dict(levels={"arithmetic": [65]}), r"level = 65: allowed an int in "
                      r"\[0, 64\]"),
                     (dict(levels={}), r"levels\['arithmetic'\]"),
                     (dict(envs={"chess": {}}), "env = 'chess'"),
                     (dict(envs={"arithmetic": {"colour": 1}}), r"envs\['arithmetic'\] kwargs"),
                     (dict(temperature=-1.0), "temperature"),
                     (dict(max_tokens=1, max_len=8), "max_tokens` = 1"),
                     (dict(policy="oracle", max_turn_tokens=8), r"max_turn_tokens = 8: the "
                      r"oracle's longest turn has \d+ tokens")]:
    with pytest.raises(ValueError, match=match):
      evaluate_agent(model, TOK, **{**kw, **bad})
  with pytest.raises(ValueError, match="chat role"):
    evaluate_agent(model, ByteTokenizer(), **kw)
  # run_eval.py's agent flags, and a run trained without the chat tokenizer.
  for values, match in [({"agent_policies": ["model", "greedy"]}, "--agent_policies"),
                        ({"agent_envs": ["chess"]}, "--agent_envs: unknown env 'chess'"),
                        ({"agent_levels": ["0", "x"]}, "--agent_levels"),
                        ({"agent_episodes": 0}, "--agent_episodes = 0")]:
    with pytest.raises(ValueError, match=match):
      options_from_flags(values)
  assert options_from_flags({"agent_brief": True, "seed": 3}) == AgentOptions(brief=True,
                                                                                 seed=3)
  # A mistyped path is named as missing (not blamed on the tokenizer), as is a directory
  # that is no run; a run without chat roles names the training flags.
  for path, match in [(tmp_path / "runs" / "rl", r"--workdir .*/runs/rl does not exist"),
                      (tmp_path, r"--workdir .* has no model_config\.json")]:
    with pytest.raises(ValueError, match=match):
      agent_eval.run_agent_eval(workdir=str(path), params=None, output_dir=None)
  (tmp_path / "model_config.json").write_text("{}")
  with pytest.raises(ValueError, match="trained with the chat tokenizer .*--config.data."
                                       "tokenizer=byte_chat --config.model.vocab_size=266"):
    agent_eval.run_agent_eval(workdir=str(tmp_path), params=None, output_dir=None)
