"""Cached decode == the training forward (tiny hybrid: AttnRes, MoE, KDA + MLA), fp32.

One engine shape is shared by every test so the file compiles each entry point once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.infer import Engine, KDACache, MLACache, trace_counts
from hybridmoe_jax.model import HybridLM
from tests._support import rel_err, rel_rms
from tests._support import tiny_model_config
from tests._support import tiny_model
from tests.infer.helpers import full_logits, random_tokens

T = 48          # sequence length of every test
PROMPT = 37     # = 2 * 16 + 5: the prefill chunks do not divide the prompt


@pytest.fixture(scope="module")
def setup():
  model = tiny_model()
  engine = Engine(model, max_len=T + 4, prefill_chunk=16, kv_block=8)
  tokens = random_tokens(1, 2, T)
  return model, engine, tokens, np.asarray(full_logits(model, tokens))


def test_teacher_forced_decode_matches_forward(setup):
  _, engine, tokens, ref = setup
  last, cache = engine.prefill(tokens[:, :PROMPT])
  steps = [last]
  for t in range(PROMPT, T - 1):
    logits, cache = engine.decode_step(tokens[:, t], cache)
    steps.append(logits)
  got = jnp.stack(steps, axis=1)              # predictions at positions PROMPT-1 .. T-2
  assert cache.length.tolist() == [T - 1, T - 1]
  assert rel_err(got, ref[:, PROMPT - 1:T - 1]) < 1e-4
  assert rel_rms(got, ref[:, PROMPT - 1:T - 1]) < 1e-4


def test_prefill_in_pieces_equals_one_prefill(setup):
  """A prompt fed as 9 + 28 tokens (cache continued) == fed at once."""
  _, engine, tokens, ref = setup
  _, cache = engine.prefill(tokens[:, :9])
  last, cache = engine.prefill(tokens[:, 9:PROMPT], cache)
  assert rel_err(last, ref[:, PROMPT - 1]) < 1e-4 and cache.length.tolist() == [PROMPT] * 2


def test_score_matches_forward(setup):
  _, engine, tokens, ref = setup
  logp = jax.nn.log_softmax(ref[:, :-1], -1)
  want = -np.take_along_axis(np.asarray(logp), np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  nll, pred = engine.score(tokens)            # 48 = 3 chunks of 16
  assert nll.shape == (2, T - 1) and rel_rms(nll, want) < 1e-5
  np.testing.assert_array_equal(pred, np.argmax(ref[:, :-1], -1))


def test_no_recompilation_across_steps_and_prompt_lengths(setup):
  _, engine, _, _ = setup
  engine.decode_step(jnp.zeros((2,), jnp.int32), engine.prefill(random_tokens(0, 2, 5))[1])
  before = trace_counts()
  for t in (3, 13, 20):                       # different prompt lengths, one chunk shape
    _, cache = engine.prefill(random_tokens(t, 2, t))
  for i in range(6):
    _, cache = engine.decode_step(jnp.array([i, i + 1]), cache)
  after = trace_counts()
  assert {k: after.get(k, 0) - before.get(k, 0) for k in ("prefill_chunk", "decode_step")} \
      == {"prefill_chunk": 0, "decode_step": 0}
  assert cache.length.tolist() == [26, 26]


def test_cache_contents(setup):
  _, engine, tokens, _ = setup
  cfg = tiny_model_config()
  _, cache = engine.prefill(tokens[:, :19])
  kda = [c for c in cache.layers if isinstance(c, KDACache)]
  (mla,) = [c for c in cache.layers if isinstance(c, MLACache)]
  assert len(kda) == 3 and all(c.state.shape == (2, 2, 32, 32) for c in kda)
  assert all(c.state.dtype == jnp.float32 and np.any(np.asarray(c.state)) for c in kda)
  assert kda[0].q_tail.shape == (2, cfg.kda.conv_size - 1, 64)
  assert mla.c.shape == (2, T + 4, 32) and mla.k_r.shape == (2, T + 4, 8)
  filled = np.any(np.asarray(mla.c) != 0, axis=-1)
  assert filled[:, :19].all() and not filled[:, 19:].any()


def test_bad_inputs(setup):
  _, engine, tokens, _ = setup
  with pytest.raises(ValueError, match="empty"):
    engine.prefill(np.zeros((1, 0), np.int32))
  with pytest.raises(ValueError, match="max_len"):
    engine.prefill(np.zeros((1, T + 5), np.int32))
  with pytest.raises(ValueError, match="vocabulary"):
    engine.prefill(np.full((1, 3), 10_000))
  _, cache = engine.prefill(tokens[:, :40])
  with pytest.raises(ValueError, match="max_len"):
    engine.prefill(tokens[:, :20], cache)
  with pytest.raises(ValueError, match="batch"):
    engine.prefill(tokens[:1, :2], cache)


def test_variant_without_attnres_rope_slot_with_qlora():
  base = tiny_model_config()
  cfg = tiny_model_config(num_layers=2, layer_kinds=("mla", "kda"),
                 attnres={"enabled": False, "block_size": 2},
                 mla={**base.mla.__dict__, "q_lora_rank": 16, "qk_rope_head_dim": 0},
                 kda={**base.kda.__dict__, "gate": "unbounded", "conv_size": 3})
  model = HybridLM(cfg, rngs=nnx.Rngs(3))
  tokens = random_tokens(3, 1, 30)
  ref = np.asarray(full_logits(model, tokens))
  engine = Engine(model, max_len=30, prefill_chunk=4, kv_block=4)
  last, cache = engine.prefill(tokens[:, :11])
  steps = [last]
  for t in range(11, 29):
    logits, cache = engine.decode_step(tokens[:, t], cache)
    steps.append(logits)
  got = np.asarray(jnp.stack(steps, 1))
  assert rel_err(got, ref[:, 10:29]) < 1e-4
