"""Rollouts on the hybrid cache: multi-turn episodes with tool results prefilled into the same
cache rows, ragged rows, forced (oracle) turns, a crashing tool, pausing and resuming, and
THE acceptance check: one training forward (no cache, fp32) over each episode's full token
sequence recomputes every recorded behaviour log-prob to 1e-5.

One model, engine and rollout batch shape for the whole file: the rollout step compiles
twice (a [B, 1] decode chunk and a [B, P] prefill chunk) and the reference forward once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.data.tokenizers.base import TokenizerError
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.infer import Engine, SamplingConfig, trace_counts
from hybridmoe_jax.infer.sampling import filter_logits, sampling_logits
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.envs import Answer, Tool, ToolCall, register_tool
from hybridmoe_jax.rl.episode import EpisodeSpec, PendingEpisode, oracle_script
from hybridmoe_jax.rl.rollout import Rollout, RolloutConfig
from tests._support import group_specs, tiny_model_config

TOK = ByteTokenizer(chat=True)
MAX_LEN = 1024          # cache capacity = the reference forward's padded width
REF_ROWS = 6            # the reference forward's batch (trajectories padded to it)
BATCH = 4


def _crash(argument: str) -> str:
  raise RuntimeError(f"the tool fell over on {argument!r}")


CRASH = "rollout_test_crash"
register_tool(Tool(CRASH, "a tool that always raises", _crash), overwrite=True)


@functools.lru_cache(maxsize=None)
def _model():
  """The smallest hybrid: one KDA layer (dense FFN), one MLA layer (MoE), AttnRes; fp32;
  vocabulary = the chat byte tokenizer's 266 ids."""
  cfg = tiny_model_config(num_layers=2, layer_kinds=("kda", "mla"), vocab_size=TOK.vocab_size)
  return HybridLM(cfg, rngs=nnx.Rngs(0))


@functools.lru_cache(maxsize=None)
def _engine():
  return Engine(_model(), max_len=MAX_LEN, prefill_chunk=128, kv_block=256)


def _rollout(**overrides):
  cfg = dict(max_tokens=900, max_turn_tokens=40, max_turns=3,
             sampling=SamplingConfig(temperature=1.0))
  cfg.update(overrides)
  return Rollout(_engine(), TOK, RolloutConfig(**cfg), batch=BATCH)


@jax.jit
def _reference_logits(state, tokens, segment_ids):
  model = nnx.merge(nnx.graphdef(_model()), state)
  return model(tokens, segment_ids=segment_ids)[0]


def _recompute(trajectories):
  """-> [len, MAX_LEN, V] fp32 logits of ONE training-style forward (no cache) over every
  trajectory's full sequence, rows padded on the right with segment id 0."""
  assert len(trajectories) <= REF_ROWS
  tokens = np.zeros((REF_ROWS, MAX_LEN), np.int32)
  seg = np.zeros_like(tokens)
  for i, t in enumerate(trajectories):
    tokens[i, :len(t.ids)] = t.ids
    seg[i, :len(t.ids)] = 1
  logits = _reference_logits(nnx.state(_model()), jnp.asarray(tokens), jnp.asarray(seg))
  return np.asarray(logits[:len(trajectories)], np.float32)


def _check_against_training_forward(trajectories, sampling: SamplingConfig):
  """Every recorded log-prob == the training forward's, 1e-5; masks == the chat format's."""
  logits = _recompute(trajectories)
  worst = 0.0
  for i, t in enumerate(trajectories):
    n = len(t.ids)
    r = chat_format.render(TOK, t.messages)
    np.testing.assert_array_equal(r.ids, t.ids)              # token-in / token-out
    np.testing.assert_array_equal(r.assistant_mask, t.loss_mask)
    np.testing.assert_array_equal(r.turn_index, t.turn_index)
    pos = np.flatnonzero(t.loss_mask)
    assert pos.size and pos[0] == t.prompt_len and pos[0] > 0
    prev = logits[i, pos - 1]                                # position t-1 predicts token t
    want = np.asarray(jax.nn.log_softmax(prev, -1))[np.arange(pos.size), t.ids[pos]]
    worst = max(worst, float(np.max(np.abs(want - t.logp[pos]))))
    np.testing.assert_allclose(t.logp[pos], want, rtol=0, atol=1e-5)
    dist = sampling_logits(jnp.asarray(prev), *sampling.as_arrays())
    want_s = np.asarray(jax.nn.log_softmax(dist, -1))[np.arange(pos.size), t.ids[pos]]
    # The temperature divides the logits, and so scales their rounding differences by 1/T.
    tol = 1e-5 / min(1.0, sampling.temperature)
    np.testing.assert_allclose(t.sample_logp[pos], want_s, rtol=0, atol=tol)
    off = t.loss_mask == 0
    assert not t.logp[off].any() and not t.sample_logp[off].any() and not t.forced[off].any()
    assert t.ids.shape == t.logp.shape == (n,) and t.logp.dtype == np.float32
  return worst


def _specs():
  """Five episodes on four rows: oracle-forced multi-turn, forced-then-free, a crashing
  tool, free sampling, and one more oracle episode that waits for a free row."""
  e0 = EpisodeSpec("arithmetic", 1, 1, group=0, sample_seed=11)
  e1 = EpisodeSpec("arithmetic", 2, 0, group=1, sample_seed=12)
  e4 = EpisodeSpec("arithmetic", 4, 0, group=4, sample_seed=14)
  return [
      EpisodeSpec(**{**e0.__dict__, "forced": oracle_script(e0)}),
      EpisodeSpec(**{**e1.__dict__, "forced": (oracle_script(e1)[0],)}),
      EpisodeSpec("arithmetic", 3, 0, group=2, sample_seed=13,
                  forced=(ToolCall(CRASH, "boom"),), env_kwargs=(("extra_tools", (CRASH,)),)),
      EpisodeSpec("arithmetic", 5, 2, group=3, sample_seed=15),
      EpisodeSpec(**{**e4.__dict__, "forced": oracle_script(e4)}),
  ]


@pytest.fixture(scope="module")
def uninterrupted():
  return _rollout().run(_specs())


def test_multi_turn_rollout_matches_the_training_forward(uninterrupted):
  res = uninterrupted
  assert [t.spec for t in res.finished] == _specs() and not res.pending
  oracle, mixed, crash, free, queued = res.finished
  worst = _check_against_training_forward(res.finished, SamplingConfig(temperature=1.0))
  print(f"largest |recorded - recomputed| log-prob: {worst:.2e}")
  # Oracle turns through the calculator: 2 tool calls + the answer, results in between.
  env = oracle.spec.make_env()
  env.reset(oracle.spec.seed, oracle.spec.level)
  values = [m.text for m in oracle.messages if m.role == "tool_result"]
  assert values == [str(v) for v in env._task.values[1:]]      # pylint: disable=protected-access
  assert (oracle.reward, oracle.finish_reason, oracle.num_turns) == (1.0, "answer", 3)
  assert isinstance(oracle.messages[-1].action, Answer) and oracle.forced.sum() == \
      oracle.loss_mask.sum()
  assert (queued.reward, queued.finish_reason, queued.num_turns) == (1.0, "answer", 2)
  # Forced first turn, then sampled turns: forced only inside turn 0 of the assistant.
  first_turn = mixed.turn_index == mixed.turn_index[mixed.prompt_len]
  assert (mixed.forced == (mixed.loss_mask * first_turn)).all()
  assert mixed.finish_reason == "max_turns" and mixed.num_turns == 3 and mixed.reward == 0.0
  # The crashing tool ends its own episode (reward 0, reason, error) and nothing else.
  assert (crash.reward, crash.finish_reason, crash.num_turns) == (0.0, "tool_error", 1)
  assert "fell over" in crash.info["error"]
  assert free.forced.sum() == 0 and free.finish_reason == "max_turns"
  # Ragged rows: different prompts, different end times.
  assert len({len(t.ids) for t in res.finished}) >= 4
  assert len({t.prompt_len for t in res.finished}) >= 2
  s = res.stats
  assert s["generated_tokens"] == sum(t.generated for t in res.finished)
  assert s["total_tokens"] == sum(len(t.ids) for t in res.finished) - len(res.finished)
  assert s["generated_tokens_per_s"] > 0 and s["total_tokens_per_s"] > s[
      "generated_tokens_per_s"]


def test_free_sampling_with_filters_rows_end_at_different_times():
  sampling = SamplingConfig(temperature=0.7, top_k=40)
  rollout = _rollout(max_turns=0, max_turn_tokens=12, sampling=sampling)
  specs = group_specs("arithmetic", [7], level=0, group_size=2, sample_seed=100) + \
      [EpisodeSpec("arithmetic", 8, 1, group=1, sample_seed=200),
       EpisodeSpec("arithmetic", 9, 3, group=2, sample_seed=300)]
  res = rollout.run(specs)
  assert [t.spec for t in res.finished] == specs
  worst = _check_against_training_forward(res.finished, sampling)
  print(f"largest |recorded - recomputed| log-prob: {worst:.2e}")
  assert {t.group for t in res.finished} == {0, 1, 2}
  assert len({len(t.ids) for t in res.finished}) >= 3
  # Turns are cut at 12 tokens (each answered with a format error); the env's turn limit
  # (horizon + 1 + 2) grows with the level; the level-3 episode reaches max_tokens first.
  assert [(t.num_turns, t.finish_reason) for t in res.finished] == [
      (4, "max_turns"), (4, "max_turns"), (5, "max_turns"), (4, "max_tokens")]
  # (its next tool result would not fit: it ends after its 4th turn, under the cap)
  assert len(res.finished[-1].ids) <= 900 and res.finished[-1].messages[-1].role == "assistant"
  # The same episodes in another order (other rows, other neighbours): the same tokens.
  again = rollout.run(specs[::-1])
  for a, b in zip(res.finished, again.finished[::-1]):
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.logp, b.logp)


def test_paused_and_resumed_episodes_equal_uninterrupted_ones(uninterrupted):
  before = trace_counts()["feed_and_draw"]
  rollout = _rollout(token_budget=23)
  res = rollout.run(_specs())
  done = {t.spec: t for t in res.finished}
  pending, rounds = res.pending, 1
  assert pending and all(p.env is not None for p in pending)
  while pending:
    if rounds == 2:    # through the checkpoint form: no live env (replayed), plain arrays
      pending = [PendingEpisode.from_tree(p.to_tree()) for p in pending]
      assert all(p.env is None for p in pending)
    res = rollout.run(pending)
    done.update({t.spec: t for t in res.finished})
    pending, rounds = res.pending, rounds + 1
    for p in pending:
      assert p.cache.batch == 1 and int(p.cache.length[0]) == p.n_cached
  assert rounds > 3
  for want in uninterrupted.finished:
    got = done[want.spec]
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
    np.testing.assert_array_equal(got.logp, want.logp)           # bit for bit
    np.testing.assert_array_equal(got.sample_logp, want.sample_logp)
    assert (got.reward, got.finish_reason, got.num_turns) == (
        want.reward, want.finish_reason, want.num_turns)
  assert trace_counts()["feed_and_draw"] == before      # no new compilations


def test_max_tokens_cuts_an_episode():
  res = _rollout(max_tokens=620).run([EpisodeSpec("arithmetic", 5, 2, sample_seed=15)])
  (t,) = res.finished
  assert t.finish_reason == "max_tokens" and t.reward == 0.0 and len(t.ids) <= 620
  np.testing.assert_array_equal(chat_format.render(TOK, t.messages).ids, t.ids)


def test_sampling_logits_is_the_sampling_pipeline():
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, 50)) * 3
  t, k, p, lim = jnp.float32(0.5), jnp.int32(5), jnp.float32(0.9), jnp.int32(40)
  masked = jnp.where(jnp.arange(50) < 40, logits, -1e30)
  want = filter_logits(masked / 0.5, k, p)
  np.testing.assert_allclose(sampling_logits(logits, t, k, p, lim), want)
  greedy = sampling_logits(logits, jnp.float32(0.0), k, p, lim)
  assert (np.asarray(greedy) == 0).sum() == 3
  np.testing.assert_array_equal(np.argmax(greedy, -1), np.argmax(masked, -1))


def test_bad_input_fails_before_compute():
  with pytest.raises(ValueError, match=r"episodes\[0\]\.env = 'nope'"):
    _rollout().run([EpisodeSpec("nope", 1, 0)])
  with pytest.raises(ValueError, match=r"arithmetic: level = 99: allowed an int in \[0, 64\]"):
    _rollout().run([EpisodeSpec("arithmetic", 1, 99)])
  with pytest.raises(ValueError, match=r"episodes\[1\]\.sample_seed = -1"):
    _rollout().run([EpisodeSpec("arithmetic", 1, 0), EpisodeSpec("arithmetic", 1, 0,
                                                                 sample_seed=-1)])
  with pytest.raises(ValueError, match=r"forced\[0\]"):
    _rollout().run([EpisodeSpec("arithmetic", 1, 0, forced=("calculator 1",))])
  with pytest.raises(ValueError, match=r"forced\[1\]: token ids must lie in \[0, 266\)"):
    _rollout().run([EpisodeSpec("arithmetic", 1, 0, forced=(None, (5, 300)))])
  with pytest.raises(ValueError, match="no room to generate"):
    _rollout(max_tokens=100).run([EpisodeSpec("arithmetic", 1, 0)])
  with pytest.raises(ValueError, match=r"max_tokens` = 2000 is invalid: allowed an integer in \[2, 1024\]"):
    _rollout(max_tokens=2000)
  with pytest.raises(ValueError, match="token_budget"):
    _rollout(token_budget=-1)
  with pytest.raises(TokenizerError, match="chat role"):
    Rollout(_engine(), ByteTokenizer(), RolloutConfig(max_tokens=900))
  with pytest.raises(ValueError, match="no episodes"):
    _rollout().run([])
