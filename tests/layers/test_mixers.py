"""KDA and gated MLA layers: packed documents never interact; gate shapes; dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import KDAConfig, MLAConfig
from hybridmoe_jax.layers.conv import ShortConv
from hybridmoe_jax.layers.kda import KDALayer
from hybridmoe_jax.layers.mla import MLALayer
from tests.conftest import rel_rms

D = 32


def _layer(kind, **kw):
  rngs = nnx.Rngs(0)
  if kind == "kda":
    cfg = KDAConfig(num_heads=2, num_v_heads=4, head_dim=16, v_head_dim=8, chunk_size=16, **kw)
  else:
    cfg = MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8, **kw)
  cls = KDALayer if kind == "kda" else MLALayer
  return cls(D, cfg, norm_eps=1e-5, dtype="float32", rngs=rngs)


@pytest.mark.parametrize("kind, kw", [("kda", {}), ("kda", {"gate": "unbounded"}),
                                      ("kda", {"output_gate_rank": 0}),
                                      ("mla", {}), ("mla", {"q_lora_rank": 8}),
                                      ("mla", {"qk_rope_head_dim": 0, "output_gate": False})])
def test_packed_equals_separate(kind, kw):
  if kind == "mla" and "qk_rope_head_dim" in kw:
    layer = MLALayer(D, MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=0, v_head_dim=8, output_gate=False),
                     norm_eps=1e-5, dtype="float32", rngs=nnx.Rngs(0))
  else:
    layer = _layer(kind, **kw)
  lens = [5, 16, 1, 22]
  x = jax.random.normal(jax.random.PRNGKey(1), (1, sum(lens), D))
  seg = jnp.concatenate([jnp.full((1, n), i + 1) for i, n in enumerate(lens)], 1)
  packed = layer(x, segment_ids=seg)
  start = 0
  for n in lens:
    alone = layer(x[:, start:start + n])
    assert rel_rms(alone, packed[:, start:start + n]) < 1e-5, (kind, n)
    start += n


def test_conv_is_causal_and_segment_local():
  conv = ShortConv(3, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(2), (1, 10, 3))
  seg = jnp.array([[1] * 6 + [2] * 4])
  y = conv(x, seg)
  y_changed = conv(x.at[:, 5].add(1.0), seg)       # last token of segment 1
  np.testing.assert_array_equal(y[:, :5], y_changed[:, :5])
  np.testing.assert_array_equal(y[:, 6:], y_changed[:, 6:])


def test_mla_gate_and_cache_shapes():
  layer = _layer("mla")
  x = jnp.ones((2, 7, D))
  assert layer.gate.kernel.shape == (D, 2 * 8)            # elementwise gate per head channel
  c, k_r = layer.latents(x)
  assert c.shape == (2, 7, 16) and k_r.shape == (2, 7, 4)  # d_c + d_rope numbers per token
  assert layer.queries(x).shape == (2, 7, 2, 12)
  assert layer(x).shape == (2, 7, D)


def test_kda_decay_is_bounded_and_fp32():
  layer = _layer("kda")
  x = 30 * jax.random.normal(jax.random.PRNGKey(3), (1, 9, D))
  g = layer.log_decay(x)
  assert g.dtype == jnp.float32 and g.shape == (1, 9, 4, 16)
  assert bool((g <= 0).all()) and bool((g >= -5.0).all())


def test_bf16_compute():
  layer = KDALayer(D, KDAConfig(num_heads=2, num_v_heads=2, head_dim=16, v_head_dim=16,
                                chunk_size=16), norm_eps=1e-5, dtype="bfloat16",
                   rngs=nnx.Rngs(0))
  y = layer(jnp.ones((1, 20, D), jnp.bfloat16))
  assert y.dtype == jnp.bfloat16 and bool(jnp.isfinite(y.astype(jnp.float32)).all())
