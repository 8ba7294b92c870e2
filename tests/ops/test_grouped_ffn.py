"""The grouped expert FFN (ops.grouped_ffn): its gradient costs the grouped work on TPU.

Compiled deviceless for one v5p chip (libtpu, the `[tpu]` extra; skipped with the reason
without it): d(loss)/d(inputs, expert weights) must cost about 9 x 2 x rows x n x I FLOPs
(three matmuls forward, six backward) and hold no dense convolution over the experts
(`lhs_dilate`: jax 0.10's transpose of `ragged_dot`, 11.2x the grouped FLOPs at the 48B
shard shapes). Numerics against the dense reference live in tests/layers/test_moe.py.
"""

import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hybridmoe_jax.ops import grouped_ffn as grouped_ffn_lib
from hybridmoe_jax.ops.grouped_ffn import grouped_ffn

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed: pip install "
                                  "-e \".[tpu]\" for the deviceless TPU compile")
_GLU = lambda a, b: jax.nn.silu(a) * b


def _compiled_grad(rows: int, n: int, inner: int, experts: int, impl: str):
  from hybridmoe_jax.parallel.topology import topology_devices  # pylint: disable=g-import-not-at-top
  mesh = Mesh(topology_devices("v5p:1x1x1")[:1], ("x",))
  put = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))

  def loss(x, wg, wu, wd, groups):
    y = grouped_ffn(x, groups, wg, wu, wd, glu=_GLU, dtype=jnp.bfloat16, impl=impl)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  args = (put((rows, n), jnp.bfloat16), put((experts, n, inner), jnp.float32),
          put((experts, n, inner), jnp.float32), put((experts, inner, n), jnp.float32),
          put((rows,), jnp.int32))
  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"]), compiled.as_text()


def _check(rows, n, inner, experts, impl):
  flops, hlo = _compiled_grad(rows, n, inner, experts, impl)
  grouped = 9 * 2 * rows * n * inner
  assert "lhs_dilate" not in hlo, "the expert weight gradient compiled to a dense convolution"
  assert flops <= 1.5 * grouped, (f"gradient costs {flops:.3e} FLOPs, {flops / grouped:.2f}x "
                                  f"the grouped {grouped:.3e}")
  kernel = r"ragged" if impl == "ragged_dot" else r"custom_call_target=\"tpu_custom_call\""
  assert re.search(kernel, hlo), f"no grouped {impl} kernel in the compiled gradient"


@needs_libtpu
@pytest.mark.parametrize("impl", ["ragged_dot", "megablox"])
def test_grouped_gradient_costs_the_grouped_work_small(impl):
  _check(rows=2048, n=256, inner=128, experts=8, impl=impl)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("impl", ["ragged_dot", "megablox"])
def test_grouped_gradient_costs_the_grouped_work_at_48b_shard_shapes(impl):
  """Kimi-Linear-48B on v5p-64, fsdp 4 x expert 8: 32,768 received rows, latent n 2,304,
  I 1,024, 32 local experts. jax 0.12.0 / libtpu 0.0.50.1: 1.00x (2026-12-06)."""
  _check(rows=32768, n=2304, inner=1024, experts=32, impl=impl)


def test_megablox_tiles_fit_both_directions():
  assert grouped_ffn_lib._megablox_tiling(32768, 2304, 1024) == (512, 1024, 1024)
  assert grouped_ffn_lib._megablox_tiling(1024, 64, 32) is None     # widths under 128 lanes
  assert grouped_ffn_lib._megablox_tiling(37, 128, 256) is None     # rows not a multiple of 8
  assert grouped_ffn_lib._megablox_tiling(40, 256, 128) == (8, 128, 128)


def test_auto_picks_megablox_on_tpu_only():
  assert grouped_ffn_lib.choose("auto", "tpu")[0] == "megablox"
  assert grouped_ffn_lib.choose("auto", "gpu")[0] == "ragged_dot"
  assert grouped_ffn_lib.choose("auto", "cpu")[0] == "ragged_dot"
  with pytest.raises(ValueError, match="allowed"):
    grouped_ffn_lib.choose("gmm")


@pytest.mark.parametrize("rows,n,inner", [(64, 128, 256), (37, 128, 256), (64, 24, 40)])
def test_megablox_matches_ragged_dot_forward_and_backward(rows, n, inner):
  """The Pallas TPU grouped matmul (interpret mode here) against XLA's ragged_dot: outputs
  and the gradients of x and all three weights, skipped rows (group G) in the batch; a
  skipped row's output is zero (the kernel leaves those rows unwritten). 37 rows (not a
  multiple of 8) and widths under 128 take the ragged_dot fallback: the same contract."""
  k = jax.random.split(jax.random.key(1), 5)
  experts = 5
  x = jax.random.normal(k[0], (rows, n))
  wg, wu = (jax.random.normal(k[i], (experts, n, inner)) * n ** -0.5 for i in (1, 2))
  wd = jax.random.normal(k[3], (experts, inner, n)) * inner ** -0.5
  groups = jax.random.randint(k[4], (rows,), 0, experts + 1).at[0].set(experts)
  kept = (groups < experts)[:, None]

  def loss(impl, *a):
    y = grouped_ffn(a[0], groups, *a[1:], glu=_GLU, dtype=jnp.float32, impl=impl)
    return jnp.sum(jnp.where(kept, y, 0.0) ** 2 + jnp.where(kept, y, 0.0)), y

  grad = lambda impl: jax.value_and_grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3),
                                         has_aux=True)(x, wg, wu, wd)
  (_, want_y), want = grad("ragged_dot")
  (_, got_y), got = grad("megablox")
  np.testing.assert_allclose(jnp.where(kept, got_y, 0.0), jnp.where(kept, want_y, 0.0),
                             rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(got_y)[~np.asarray(kept[:, 0])]), "a skipped row is not zero"
  for g, w in zip(got, want):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_grouped_ffn_matches_per_row_experts_in_float32():
  """Every row through its own expert, rows in any order, the skip group G left out."""
  k = jax.random.split(jax.random.key(0), 5)
  rows, n, inner, experts = 11, 6, 5, 3
  x = jax.random.normal(k[0], (rows, n))
  wg, wu = (jax.random.normal(k[i], (experts, n, inner)) for i in (1, 2))
  wd = jax.random.normal(k[3], (experts, inner, n))
  groups = jax.random.randint(k[4], (rows,), 0, experts + 1)
  y = grouped_ffn(x, groups, wg, wu, wd, glu=_GLU, dtype=jnp.float32)
  assert y.dtype == jnp.float32
  for r in range(rows):
    g = int(groups[r])
    if g == experts:
      continue
    want = _GLU(x[r] @ wg[g], x[r] @ wu[g]) @ wd[g]
    np.testing.assert_allclose(y[r], want, rtol=1e-4, atol=1e-4)
  assert grouped_ffn(x, groups, wg, wu, wd, glu=_GLU, dtype=jnp.bfloat16).dtype == jnp.bfloat16
