"""KDA, gated MLA and the short conv: packed documents never interact; a cached forward fed
in pieces (padded chunks, single tokens, ragged rows) equals the training forward; the
absorbed MLA decode equals the expanded form; gate shapes; dtypes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, KDAConfig, MLAConfig
from hybridmoe_jax.layers.conv import ShortConv
from hybridmoe_jax.layers.kda import KDACache, KDALayer
from hybridmoe_jax.layers.mla import MLACache, MLALayer
from hybridmoe_jax.ops.attention.absorbed import absorb, latent_attention_partial, unabsorb
from tests._support import rel_rms

D = 32
F32 = ComputeConfig(kda_chunk_size=16)


def _kda_cfg(**kw):
  return KDAConfig(**{**dict(num_heads=2, num_v_heads=4, head_dim=16, v_head_dim=8), **kw})


def _mla_cfg(**kw):
  base = dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=8)
  return MLAConfig(**{**base, **kw})


def _layer(kind, compute=F32, **kw):
  cls, cfg = (KDALayer, _kda_cfg(**kw)) if kind == "kda" else (MLALayer, _mla_cfg(**kw))
  return cls(D, cfg, norm_eps=1e-5, compute=compute, rngs=nnx.Rngs(0))


@functools.partial(nnx.jit, static_argnames=("kv_block",))
def _call(layer, x, segment_ids=None, cache=None, length=None, kv_block=None):
  """layer(x, ...) jitted: one XLA program per layer and shape (eagerly every op is compiled
  on its own for each new shape, about twice the CPU time). kv_block (MLA with a cache) also
  passes `length`."""
  kw = dict(segment_ids=segment_ids, cache=cache)
  if kv_block is not None:
    kw.update(length=length, kv_block=kv_block)
  return layer(x, **kw)


def _empty_cache(layer, batch, max_len):
  if isinstance(layer, KDALayer):
    return KDACache.zeros(layer.cfg, batch, "float32")
  return MLACache.zeros(layer.cfg, batch, max_len, "float32")


def _cached(layer, x, cache, length, n_valid, width):
  """Feed x [B, n] (n = max n_valid) as one chunk of `width` rows, n_valid [B] real."""
  x = jnp.pad(x, ((0, 0), (0, width - x.shape[1]), (0, 0)))
  seg = (jnp.arange(width)[None] < jnp.asarray(n_valid)[:, None]).astype(jnp.int32)
  if isinstance(layer, MLALayer):
    return _call(layer, x, segment_ids=seg, cache=cache, length=length, kv_block=4)
  return _call(layer, x, segment_ids=seg, cache=cache)


MIXERS = [("kda", {}), ("kda", {"gate": "unbounded"}), ("kda", {"output_gate_rank": 0}),
          ("kda", {"num_heads": 1, "conv_size": 3}),
          ("mla", {}), ("mla", {"q_lora_rank": 8}),
          ("mla", {"qk_rope_head_dim": 0, "output_gate": False}),
          ("mla", {"rope_theta": 100.0}),   # RoPE on the rope slot (the NoPE ablation)
          ("mla", {"logn_base": 4})]        # log-length scaled scores past 4 tokens


@pytest.mark.parametrize("kind, kw", MIXERS)
def test_packed_equals_separate(kind, kw):
  layer = _layer(kind, **kw)
  lens = [5, 16, 1, 22]
  x = jax.random.normal(jax.random.PRNGKey(1), (1, sum(lens), D))
  seg = jnp.concatenate([jnp.full((1, n), i + 1) for i, n in enumerate(lens)], 1)
  packed, none = _call(layer, x, segment_ids=seg)
  assert none is None
  start = 0
  for n in lens:
    alone, _ = _call(layer, x[:, start:start + n])
    assert rel_rms(packed[:, start:start + n], alone) < 1e-5, (kind, n)
    start += n


@pytest.mark.parametrize("kind, kw", MIXERS)
def test_cached_pieces_equal_training_forward(kind, kw):
  """21 tokens fed as 7 (padded to 8), 1, 1, 0 (all padding), 12 (two chunks of 8 with the
  second half padding): every real output equals the uncached forward."""
  layer = _layer(kind, **kw)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 21, D))
  ref, _ = _call(layer, x)
  cache, length, outs, s = _empty_cache(layer, 2, 24), jnp.zeros((2,), jnp.int32), [], 0
  for n, width in ((7, 8), (1, 1), (1, 1), (0, 4), (8, 8), (4, 8)):
    y, cache = _cached(layer, x[:, s:s + n], cache, length, [n, n], width)
    outs.append(y[:, :n])
    s, length = s + n, length + n
  got = jnp.concatenate(outs, 1)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  if kind == "mla":   # latents written at 0..20, nothing after
    filled = np.any(np.asarray(cache.c) != 0, axis=-1)
    assert filled[:, :21].all() and not filled[:, 21:].any()


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_ragged_rows_equal_each_row_alone(kind):
  """Row 0 holds 3 tokens then 6, row 1 holds 8 then 0 (padding only), in one cache."""
  layer = _layer(kind)
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 9, D))
  cache = _empty_cache(layer, 2, 12)
  y1, cache = _cached(layer, x[:, :8], cache, jnp.zeros((2,), jnp.int32), [3, 8], 8)
  second = jnp.stack([x[0, 3:9], jnp.zeros((6, D))])
  y2, cache = _cached(layer, second, cache, jnp.array([3, 8]), [6, 0], 8)
  row0 = jnp.concatenate([y1[0, :3], y2[0, :6]])
  np.testing.assert_allclose(row0, _call(layer, x[:1, :9])[0][0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y1[1], _call(layer, x[1:, :8])[0][0], rtol=1e-5, atol=1e-5)
  # One more token per row: each continues its own sequence.
  z = jax.random.normal(jax.random.PRNGKey(4), (2, 1, D))
  y3, _ = _cached(layer, z, cache, jnp.array([9, 8]), [1, 1], 1)
  alone0 = _call(layer, jnp.concatenate([x[:1, :9], z[:1]], 1))[0][0, -1]
  alone1 = _call(layer, jnp.concatenate([x[1:, :8], z[1:]], 1))[0][0, -1]
  np.testing.assert_allclose(y3[:, 0], jnp.stack([alone0, alone1]), rtol=1e-5, atol=1e-5)


def test_kda_padding_leaves_the_cache_unchanged():
  layer = _layer("kda")
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 6, D))
  _, cache = _cached(layer, x, KDACache.zeros(layer.cfg, 2, "float32"), None, [6, 6], 6)
  _, same = _cached(layer, 5 * x, cache, None, [0, 0], 6)
  for a, b in zip(cache, same):
    np.testing.assert_array_equal(a, b)


def test_conv_cache_equals_short_conv():
  conv = ShortConv(6, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(6), (2, 11, 6))
  tail, outs = jnp.zeros((2, 3, 6)), []
  for s, n in ((0, 5), (5, 1), (6, 5)):       # the middle chunk is 1 real + 4 padding rows
    part = jnp.pad(x[:, s:s + n], ((0, 0), (0, 5 - n), (0, 0)))
    seg = (jnp.arange(5) < n).astype(jnp.int32)[None].repeat(2, 0)
    y, tail = conv(part, seg, cache=tail)
    outs.append(y[:, :n])
  full, none = conv(x)
  assert none is None
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(tail, x[:, -3:])
  # Ragged rows: each row's tail ends at its own last real token.
  seg = jnp.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
  _, tail = conv(x[:, :5], seg, cache=jnp.zeros((2, 3, 6)))
  np.testing.assert_array_equal(tail[0], jnp.concatenate([jnp.zeros((1, 6)), x[0, :2]]))
  np.testing.assert_array_equal(tail[1], x[1, 1:4])
  with pytest.raises(ValueError, match="conv cache"):
    conv(x, cache=jnp.zeros((2, 2, 6)))


def _expanded_attention(layer, q, cache, q_pos):
  """The training form over the whole cache (k_h = [W_uk_h c ; k_r], v_h = W_uv_h c): the
  exact reference of the absorbed blockwise form. q [B, T, H, Dn + Dr] -> [B, T, H, Dv]."""
  w_uk, w_uv = layer._up_kernels()
  b, n, _ = cache.c.shape
  h = layer.cfg.num_heads
  k = jnp.einsum("bnc,chd->bnhd", cache.c, w_uk)
  k_r = jnp.broadcast_to(cache.k_r[:, :, None, :], (b, n, h, cache.k_r.shape[-1]))
  k = jnp.concatenate([k, k_r.astype(k.dtype)], axis=-1)
  v = jnp.einsum("bnc,chd->bnhd", cache.c, w_uv)
  s = jnp.einsum("bthd,bnhd->bhtn", q, k, preferred_element_type=jnp.float32)
  s = s * layer.cfg.qk_head_dim ** -0.5
  visible = jnp.arange(n)[None, None, :] <= q_pos[..., None]              # [B, T, N]
  s = jnp.where(visible[:, None], s, -1e30)
  probs = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhtn,bnhd->bthd", probs.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)


@pytest.mark.parametrize("kw,q_pos", [
    ({}, [[2, 3, 4, 5], [7, 8, 9, 10]]),
    ({"qk_rope_head_dim": 0, "q_lora_rank": 8}, [[2, 3, 4, 5], [7, 8, 9, 10]]),
    ({}, [[6, 7, 8, 9], [7, 8, 9, 10]]),      # two unmasked blocks before the edge ones
    ({}, [[0, 1, 2, 3], [7, 8, 9, 10]])])     # none
def test_absorbed_mla_attention_equals_expanded(kw, q_pos):
  """On a partly filled cache with per-row query positions, blocks of 3 keys (the last one
  overhanging the capacity 11; the blocks every query sees whole skip the mask) == the
  expanded training form over the whole cache."""
  layer = _layer("mla", **kw)
  keys = jax.random.split(jax.random.PRNGKey(7), 3)
  cfg = layer.cfg
  cache = MLACache(jax.random.normal(keys[0], (2, 11, cfg.kv_lora_rank)),
                   jax.random.normal(keys[1], (2, 11, cfg.qk_rope_head_dim)))
  q = jax.random.normal(keys[2], (2, 4, cfg.num_heads, cfg.qk_head_dim))
  q_pos = jnp.array(q_pos)
  w_uk, w_uv = layer._up_kernels()
  _, l, acc = latent_attention_partial(absorb(q, w_uk), cache.c, cache.k_r, q_pos,
                                       q_pos[:, -1] + 1, cfg.qk_head_dim ** -0.5, 3)
  a = unabsorb(acc / jnp.maximum(l, 1e-30)[..., None], w_uv, q.dtype)
  e = _expanded_attention(layer, q, cache, q_pos)
  assert a.shape == (2, 4, cfg.num_heads, cfg.v_head_dim) and a.dtype == jnp.float32
  np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_mla_cache_needs_length():
  layer = _layer("mla")
  with pytest.raises(ValueError, match="length"):
    layer(jnp.ones((1, 2, D)), cache=MLACache.zeros(layer.cfg, 1, 4, "float32"))


def test_conv_is_causal_and_segment_local():
  conv = ShortConv(3, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(2), (1, 10, 3))
  seg = jnp.array([[1] * 6 + [2] * 4])
  y, _ = conv(x, seg)
  y_changed, _ = conv(x.at[:, 5].add(1.0), seg)       # last token of segment 1
  np.testing.assert_array_equal(y[:, :5], y_changed[:, :5])
  np.testing.assert_array_equal(y[:, 6:], y_changed[:, 6:])


def test_mla_gate_and_cache_shapes():
  layer = _layer("mla")
  x = jnp.ones((2, 7, D))
  assert layer.gate.kernel.shape == (D, 2 * 8)            # elementwise gate per head channel
  c, k_r = layer.latents(x)
  assert c.shape == (2, 7, 16) and k_r.shape == (2, 7, 4)  # d_c + d_rope numbers per token
  assert layer.queries(x).shape == (2, 7, 2, 12)
  assert layer(x)[0].shape == (2, 7, D)


def test_kda_decay_is_bounded_and_fp32():
  layer = _layer("kda")
  x = 30 * jax.random.normal(jax.random.PRNGKey(3), (1, 9, D))
  g = layer.log_decay(x)
  assert g.dtype == jnp.float32 and g.shape == (1, 9, 4, 16)
  assert bool((g <= 0).all()) and bool((g >= -5.0).all())


def test_bf16_compute():
  layer = KDALayer(D, KDAConfig(num_heads=2, num_v_heads=2, head_dim=16, v_head_dim=16),
                   norm_eps=1e-5, compute=ComputeConfig(dtype="bfloat16", kda_chunk_size=16),
                   rngs=nnx.Rngs(0))
  y, _ = _call(layer, jnp.ones((1, 20, D), jnp.bfloat16))
  assert y.dtype == jnp.bfloat16 and bool(jnp.isfinite(y.astype(jnp.float32)).all())
  _, cache = _call(layer, jnp.ones((1, 3, D), jnp.bfloat16),
                   cache=KDACache.zeros(layer.cfg, 1, "bfloat16"))
  assert cache.q_tail.dtype == jnp.bfloat16 and cache.state.dtype == jnp.float32
