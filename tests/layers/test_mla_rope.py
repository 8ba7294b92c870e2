"""Positions in MLA. RoPE on the rope slot (`model.mla.rope_theta`, the ablation of NoPE): the
rotation keeps norms and makes scores depend on the offset only; per-document positions in
packed rows; rope_theta = 0 leaves the layer as it was. Log-length scaling
(`model.mla.logn_base`): the layer equals softmax attention written out with its scores times
max(1, log n / log base). Both refused under context parallelism. (Packed == separate and
cached == training for both: tests/layers/test_mixers.py MIXERS.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ConfigError, MLAConfig
from hybridmoe_jax.layers.mla import MLALayer, rope, segment_positions
from hybridmoe_jax.ops.plan import ExecutionPlan, execution_plan


def test_rope_is_a_rotation_relative_in_position():
  q, k = jax.random.normal(jax.random.PRNGKey(0), (2, 1, 1, 8))
  def score(i, j):
    return float(jnp.sum(rope(q, jnp.array([[i]]), 100.0) * rope(k, jnp.array([[j]]), 100.0)))
  assert score(5, 3) == pytest.approx(score(12, 10), rel=1e-5)
  assert score(5, 3) == pytest.approx(score(1005, 1003), rel=1e-4)
  assert abs(score(5, 3) - score(5, 4)) > 1e-3                   # the offset matters
  assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), rel=1e-6)   # 0: identity
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 3, 8))
  pos = jnp.broadcast_to(jnp.arange(6) * 7, (2, 6))
  np.testing.assert_allclose(jnp.linalg.norm(rope(x, pos, 1e4), axis=-1),
                             jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_segment_positions_restart_per_document():
  seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]])
  np.testing.assert_array_equal(segment_positions(seg, 2, 8),
                                [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])
  np.testing.assert_array_equal(segment_positions(None, 1, 3), [[0, 1, 2]])


def test_nope_default_unchanged_and_rope_changes_the_output():
  cfg = dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8)
  x = jax.random.normal(jax.random.PRNGKey(2), (1, 9, 32))
  nope = MLALayer(32, MLAConfig(**cfg), norm_eps=1e-5, rngs=nnx.Rngs(0))(x)[0]
  same = MLALayer(32, MLAConfig(**cfg, rope_theta=0.0), norm_eps=1e-5, rngs=nnx.Rngs(0))(x)[0]
  roped = MLALayer(32, MLAConfig(**cfg, rope_theta=10.0), norm_eps=1e-5, rngs=nnx.Rngs(0))(x)[0]
  np.testing.assert_array_equal(nope, same)
  np.testing.assert_allclose(nope[:, 0], roped[:, 0], rtol=1e-5, atol=1e-6)  # position 0
  assert float(jnp.max(jnp.abs(nope[:, 1:] - roped[:, 1:]))) > 1e-4


def test_rope_config_checks_and_context_refusal():
  with pytest.raises(ConfigError, match="rope_theta"):
    MLAConfig(rope_theta=-1.0)
  with pytest.raises(ConfigError, match="qk_rope_head_dim"):
    MLAConfig(qk_rope_head_dim=3, rope_theta=1e4)
  layer = MLALayer(32, MLAConfig(rope_theta=1e4), norm_eps=1e-5, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="context parallelism"):
    with execution_plan(ExecutionPlan(context=object())):
      layer(jnp.zeros((1, 4, 32)))


def _written_out(layer: MLALayer, x: jax.Array, base: int) -> jax.Array:
  """The layer's output from its own projections: causal softmax over expanded keys, each
  query's scores times max(1, log(t + 1) / log(base)) at its position t (fp32)."""
  cfg, (b, t, _) = layer.cfg, x.shape
  q = layer.queries(x).astype(jnp.float32)
  c, k_r = layer.latents(x)
  w_uk, w_uv = layer._up_kernels()
  k = jnp.concatenate([jnp.einsum("btc,chd->bthd", c, w_uk),
                       jnp.broadcast_to(k_r[:, :, None], (b, t, cfg.num_heads,
                                                          cfg.qk_rope_head_dim))], -1)
  v = jnp.einsum("btc,chd->bthd", c, w_uv)
  mult = np.maximum(1.0, np.log(np.arange(t) + 1.0) / np.log(base)) if base else np.ones(t)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * cfg.qk_head_dim ** -0.5 * mult[:, None]
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
  o = o * jax.nn.sigmoid(layer.gate(x))
  return layer.o_proj(o)


@pytest.mark.parametrize("base", [0, 3, 40])
def test_logn_scaling_equals_written_out_attention(base):
  cfg = MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                  v_head_dim=8, logn_base=base)
  layer = MLALayer(32, cfg, norm_eps=1e-5, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 30, 32))
  np.testing.assert_allclose(layer(x)[0], _written_out(layer, x, base), rtol=2e-4, atol=2e-5)
  if base == 3:   # positions 0-2 unscaled (n <= base), then sharper: not the plain layer
    plain = MLALayer(32, dataclasses.replace(cfg, logn_base=0), norm_eps=1e-5,
                     rngs=nnx.Rngs(0))(x)[0]
    y = layer(x)[0]
    np.testing.assert_allclose(y[:, :3], plain[:, :3], rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(y[:, 3:] - plain[:, 3:]))) > 1e-4


def test_logn_config_checks_and_context_refusal():
  with pytest.raises(ConfigError, match="logn_base"):
    MLAConfig(logn_base=1)
  with pytest.raises(ConfigError, match="logn_base"):
    MLAConfig(logn_base=-2)
  layer = MLALayer(32, MLAConfig(logn_base=64), norm_eps=1e-5, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="logn_base"):
    with execution_plan(ExecutionPlan(context=object())):
      layer(jnp.zeros((1, 4, 32)))
