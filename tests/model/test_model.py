"""The whole decoder: shapes, causality, packed documents, routing stats, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ComputeConfig
from hybridmoe_jax.model import HybridLM
from tests._support import rel_rms, tiny_model, tiny_model_config


# Model-level tests default to the token-scan KDA: it compiles in a fraction of the chunked
# path's time, and chunked == recurrent is tested in tests/ops/test_kda.py
# (test_chunked_kda_in_model_matches_recurrent keeps the chunked path in the model).
RECURRENT = ComputeConfig(kda_impl="recurrent")


@nnx.jit
def _forward(model, tokens, segment_ids=None):
  """model(tokens, segment_ids=...) -> (logits, aux), jitted: one XLA program per model and
  shape (eagerly every op of the forward is compiled on its own for each new shape: about
  twice the CPU time; the programs run are the training step's)."""
  return model(tokens, segment_ids=segment_ids)


@pytest.fixture(scope="module")
def tiny():
  model = tiny_model(compute=RECURRENT)
  return model.cfg, model


def test_chunked_kda_in_model_matches_recurrent(tiny):
  _, model = tiny
  chunked = HybridLM(tiny_model_config(), rngs=nnx.Rngs(0),
                     compute=ComputeConfig(kda_impl="chunked"))
  tokens = _tokens(7, 1, 70)
  seg = jnp.concatenate([jnp.ones((1, 30), jnp.int32), jnp.full((1, 40), 2, jnp.int32)], 1)
  assert rel_rms(_forward(chunked, tokens, seg)[0], _forward(model, tokens, seg)[0]) < 1e-5


def _tokens(key, b, t, vocab=256):
  return jax.random.randint(jax.random.PRNGKey(key), (b, t), 0, vocab)


def test_shapes_and_stats(tiny):
  cfg, model = tiny
  logits, aux = _forward(model, _tokens(0, 2, 37))
  assert logits.shape == (2, 37, cfg.vocab_size) and logits.dtype == jnp.float32
  # Shaped like the routing-bias state: {"layers": {i: {"ffn": {"bias": stats}}}}.
  assert sorted(aux["moe"]["layers"]) == list(cfg.moe_layers)
  for layer in aux["moe"]["layers"].values():
    stats = layer["ffn"]["bias"]
    assert stats["load"].shape == (cfg.moe.num_experts,)
    assert int(stats["load"].sum()) == 2 * 37 * cfg.moe.experts_per_token
    assert stats["qb_hist"].shape == (cfg.moe.num_experts, cfg.moe.qb_num_bins)


def test_causal(tiny):
  _, model = tiny
  tokens = _tokens(1, 2, 37)    # test_shapes_and_stats' shape: its compiled program
  base, _ = _forward(model, tokens)
  t = 21
  changed, _ = _forward(model, tokens.at[0, t].set((tokens[0, t] + 7) % 256))
  np.testing.assert_array_equal(np.asarray(base[0, :t]), np.asarray(changed[0, :t]))
  assert not np.allclose(base[0, t:], changed[0, t:])


def test_packed_documents_equal_separate_runs(tiny):
  _, model = tiny
  lens = [23, 1, 50, 19]   # boundaries inside and across 64-token KDA chunks
  docs = [_tokens(10 + i, 1, n) for i, n in enumerate(lens)]
  packed = jnp.concatenate(docs, axis=1)
  seg = jnp.concatenate([jnp.full((1, n), i + 1, jnp.int32) for i, n in enumerate(lens)], 1)
  logits, _ = _forward(model, packed, seg)
  # Reference: each document alone in its own row, right-padded (causal: padding after a
  # document cannot change it), so one call covers all four.
  width = max(lens)
  rows = jnp.concatenate([jnp.pad(d, ((0, 0), (0, width - n))) for d, n in zip(docs, lens)])
  valid = (jnp.arange(width)[None] < jnp.asarray(lens)[:, None]).astype(jnp.int32)
  alone, _ = _forward(model, rows, valid)
  start = 0
  for i, n in enumerate(lens):
    assert rel_rms(logits[0, start:start + n], alone[i, :n]) < 1e-5
    start += n


def test_padding_excluded_from_routing_stats(tiny):
  cfg, model = tiny
  # [1, 70] with segment ids: test_chunked_kda_in_model_matches_recurrent's program
  tokens = _tokens(3, 1, 70)
  seg = jnp.concatenate([jnp.ones((1, 47), jnp.int32), jnp.zeros((1, 23), jnp.int32)], 1)
  _, aux = _forward(model, tokens, seg)
  for layer in aux["moe"]["layers"].values():
    stats = layer["ffn"]["bias"]
    assert int(stats["load"].sum()) == 47 * cfg.moe.experts_per_token
    assert int(stats["qb_hist"].sum()) == 47 * cfg.moe.num_experts


@pytest.mark.parametrize("overrides, dtype", [
    ({"attnres": {"enabled": False}}, "float32"),
    ({}, "bfloat16"),
    ({"kda": {"gate": "unbounded", "output_gate_rank": 0, "num_heads": 1, "num_v_heads": 2},
      "mla": {"q_lora_rank": 16, "output_gate": False}, "moe": {"glu": "swiglu", "latent_dim": 0}},
     "float32"),
])
def test_variants_run_and_are_finite(overrides, dtype):
  cfg = tiny_model_config(**overrides)
  compute = ComputeConfig(dtype=dtype, kda_impl="recurrent")
  model = HybridLM(cfg, rngs=nnx.Rngs(1), compute=compute)
  logits, _ = _forward(model, _tokens(4, 2, 20))
  assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())


def test_remat_matches_plain_gradients():
  # One KDA + one MLA layer (dense FFN, then MoE) in two AttnRes blocks: every kind of
  # layer remat wraps, and a block boundary, at half the tiny preset's compile time
  cfg = tiny_model_config(num_layers=2, layer_kinds=("kda", "mla"), attnres={"block_size": 1})
  grads = []
  for remat in ("none", "full"):
    compute = ComputeConfig(remat=remat, kda_impl="recurrent")
    model = HybridLM(cfg, rngs=nnx.Rngs(2), compute=compute)
    loss = lambda m: m(_tokens(5, 1, 16))[0].mean()
    grads.append(jax.tree.leaves(nnx.jit(nnx.grad(loss))(model)))
  for a, b in zip(*grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
