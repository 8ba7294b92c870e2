"""RoPE on the MLA rope slot (`model.mla.rope_theta`, the ablation of NoPE): the rotation keeps
norms and makes scores depend on the offset only; per-document positions in packed rows;
rope_theta = 0 leaves the layer as it was; refused under context parallelism. (Packed ==
separate and cached == training for a RoPE layer: tests/layers/test_mixers.py MIXERS.)"""

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
