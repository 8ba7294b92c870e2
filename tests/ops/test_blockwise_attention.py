"""Blockwise causal attention == the dense reference, forward and gradients; O(T x block)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, MLAConfig
from hybridmoe_jax.layers.mla import MLALayer
from hybridmoe_jax.ops.attention.api import resolve_impl
from hybridmoe_jax.ops.attention.blockwise import blockwise_attention
from hybridmoe_jax.ops.attention.dense import causal_attention
from hybridmoe_jax.ops.attention.reference import attention_reference
from tests._support import rel_err, rel_rms
from tests.ops.attention_helpers import (attention_inputs, packed_segments,
                                        value_and_grads)


@pytest.mark.parametrize("b,t,h,hk,d,dv,bq,bk,packed", [
    (2, 37, 4, 2, 8, 6, 8, 16, True),     # odd T, grouped heads, blocks not dividing T
    (1, 64, 2, 1, 8, 8, 16, 16, False),   # MQA (the absorbed MLA form), exact blocks
    (2, 50, 4, 1, 16, 8, 7, 5, True),     # odd block sizes, packed
    (1, 33, 2, 2, 8, 8, 64, 64, True),    # one block larger than T
])
def test_matches_dense_reference_fp32(b, t, h, hk, d, dv, bq, bk, packed):
  q, k, v, w = attention_inputs(t, b, t, t, h, hk, d, dv)
  seg = packed_segments(t, b, t) if packed else None
  got = value_and_grads(lambda *a: blockwise_attention(*a, segment_ids=seg, block_q=bq,
                                                        block_kv=bk), q, k, v, w)
  kw = dict(q_segment_ids=seg, kv_segment_ids=seg) if packed else {}
  ref = value_and_grads(lambda *a: attention_reference(*a, **kw), q, k, v, w)
  for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
    assert a.shape == r.shape and a.dtype == r.dtype
    assert rel_err(a, r) < 1e-5, name


def test_reference_equals_the_dense_mla_core():
  """The reference's semantics are those of ops.attention.dense.causal_attention (same heads)."""
  q, k, v, _ = attention_inputs(0, 2, 29, 29, 2, 2, 8, 8)
  seg = packed_segments(1, 2, 29)
  np.testing.assert_allclose(
      jax.jit(attention_reference)(q, k, v, q_segment_ids=seg, kv_segment_ids=seg),
      jax.jit(causal_attention)(q, k, v, segment_ids=seg), rtol=1e-6, atol=1e-6)


def test_query_shard_against_gathered_keys_and_fully_masked_rows():
  """Queries at positions 30..42 of 45 keys (a context-parallel shard); some queries hold a
  segment id no key has: output 0 and zero gradient, as in the reference."""
  b, tk, tq, off = 2, 45, 13, 30
  q, k, v, w = attention_inputs(3, b, tq, tk, 4, 2, 8, 8)
  kv_seg = packed_segments(4, b, tk)
  q_seg = kv_seg[:, off:off + tq].at[:, 3:6].set(9)       # 9: no key has it
  kw = dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=off)
  got = value_and_grads(lambda *a: blockwise_attention(*a, block_q=4, block_kv=8, **kw),
                         q, k, v, w)
  ref = value_and_grads(lambda *a: attention_reference(*a, **kw), q, k, v, w)
  assert np.all(np.asarray(got[0])[:, 3:6] == 0) and np.all(np.asarray(got[1])[:, 3:6] == 0)
  for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
    assert np.all(np.isfinite(np.asarray(a))), name
    assert rel_err(a, r) < 1e-5, name


def test_bf16_within_flash_tolerance():
  """bf16 inputs (fp32 softmax statistics) against the fp32 reference: fla's bf16
  tolerance (relative RMS error <= 1e-2), forward and gradients."""
  q, k, v, w = attention_inputs(5, 2, 70, 70, 4, 2, 16, 16)
  seg = packed_segments(6, 2, 70)
  bf = lambda x: x.astype(jnp.bfloat16)
  got = value_and_grads(lambda *a: blockwise_attention(*a, segment_ids=seg, block_q=16,
                                                        block_kv=16), bf(q), bf(k), bf(v), w)
  ref = value_and_grads(lambda *a: attention_reference(*a, q_segment_ids=seg,
                                                        kv_segment_ids=seg), q, k, v, w)
  for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
    assert a.dtype == jnp.bfloat16
    assert rel_rms(a, r) < 1e-2, name


def _temp_bytes(fn, t):
  q, k, v, w = (jax.ShapeDtypeStruct(s.shape, s.dtype) for s in attention_inputs(0, 1, t, t, 1, 1, 8, 8))
  loss = lambda q, k, v, w: jnp.sum(fn(q, k, v) * w)
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, w).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_not_quadratically():
  """XLA's own buffer accounting for forward + backward: doubling T doubles the blockwise
  temporaries (O(T x block)); the dense core's grow 4x and exceed a [T, T] fp32 matrix."""
  blockwise = lambda q, k, v: blockwise_attention(q, k, v, block_q=64, block_kv=64)
  dense = lambda q, k, v: causal_attention(q, k, v)
  small, large = _temp_bytes(blockwise, 1024), _temp_bytes(blockwise, 2048)
  assert large < 2.5 * small, (small, large)
  assert large < 2048 * 2048 * 4 / 8, large        # far below one [T, T] fp32 matrix
  d_small, d_large = _temp_bytes(dense, 1024), _temp_bytes(dense, 2048)
  assert d_large > 3.5 * d_small and d_large >= 2048 * 2048 * 4, (d_small, d_large)


def test_auto_rule_and_bad_input():
  cpu = dict(backend="cpu", block=128, head_dim=8, v_head_dim=8, dtype="float32",
             has_segments=True)
  assert resolve_impl("auto", seq_len=512, **cpu)[0] == "dense"
  assert resolve_impl("auto", seq_len=513, **cpu)[0] == "blockwise"
  assert resolve_impl("blockwise", seq_len=16, **cpu)[0] == "blockwise"
  q, k, v, _ = attention_inputs(0, 1, 8, 8, 3, 2, 8, 8)
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    blockwise_attention(q, k, v)
  q, k, v, _ = attention_inputs(0, 1, 8, 8, 2, 2, 8, 8)
  with pytest.raises(ValueError, match="q_offset=4"):
    blockwise_attention(q, k, v, q_offset=4)
  with pytest.raises(ValueError, match="segment ids must be"):
    blockwise_attention(q, k, v, segment_ids=jnp.ones((1, 7), jnp.int32))


@pytest.mark.parametrize("core", ["blockwise", "dense", "reference"])
def test_float_segment_ids_are_refused(core):
  """Float ids 0.0 / 0.5 are two documents to the dense core but one to the int32 cores
  (blockwise casts them): every core refuses them, naming the argument."""
  q, k, v, _ = attention_inputs(0, 1, 8, 8, 2, 2, 8, 8)
  seg = jnp.asarray([[0.0] * 3 + [0.5] * 5], jnp.float32)
  run = {"blockwise": lambda: blockwise_attention(q, k, v, segment_ids=seg, block_q=4,
                                                  block_kv=4),
         "dense": lambda: causal_attention(q, k, v, segment_ids=seg),
         "reference": lambda: attention_reference(q, k, v, q_segment_ids=seg,
                                                  kv_segment_ids=seg)}[core]
  with pytest.raises(ValueError, match="segment ids must be an integer array.*float32"):
    run()
  # Integer ids of any width are taken.
  blockwise_attention(q, k, v, segment_ids=jnp.asarray([[0] * 3 + [1] * 5], jnp.int8))


def test_dense_core_refuses_grouped_heads_clearly():
  """The dense core takes H == Hk only: grouped heads are refused by name, not by an einsum
  label error; blockwise takes them."""
  q, k, v, _ = attention_inputs(0, 1, 8, 8, 4, 2, 8, 8)
  with pytest.raises(ValueError, match=r"dense attention needs H == Hk"):
    causal_attention(q, k, v)
  assert blockwise_attention(q, k, v).shape == (1, 8, 4, 8)


def test_mla_layer_blockwise_equals_dense():
  """The MLA training forward and its parameter gradients agree between the two cores."""
  cfg = MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                  v_head_dim=8)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 45, 32)), jnp.float32)
  seg = packed_segments(7, 2, 45)
  outs = {}
  for impl in ("dense", "blockwise"):
    layer = MLALayer(32, cfg, norm_eps=1e-6, rngs=nnx.Rngs(0),
                     compute=ComputeConfig(mla_impl=impl, mla_block=8))

    def loss(layer):
      return jnp.sum(jnp.sin(layer(x, segment_ids=seg)[0]))

    @nnx.jit   # one program, not op-by-op (see _value_and_grads)
    def out_and_grads(layer):
      return layer(x, segment_ids=seg)[0], nnx.grad(loss)(layer)

    outs[impl] = out_and_grads(layer)
  assert rel_err(outs["blockwise"][0], outs["dense"][0]) < 1e-5
  g_block, g_dense = (jax.tree.leaves(nnx.to_pure_dict(outs[i][1]))
                      for i in ("blockwise", "dense"))
  for a, r in zip(g_block, g_dense):
    assert rel_err(a, r) < 1e-4
