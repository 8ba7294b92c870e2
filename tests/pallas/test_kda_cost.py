"""The TPU kernels' pl.CostEstimate (pallas_kernels/kda/cost.py) against an independent
count: the matmul flops and exp calls of the kernel math itself, traced to a jaxpr
(chunk_math.chunk_apply, the per-chunk function both TPU kernels run, and its vjp, which
the backward kernel runs), summed over its dot_general and exp equations."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import cost
from pallas_kernels.kda.chunk_math import SUB, chunk_apply
from pallas_kernels.kda.config import TpuConfig, lax_precision
from pallas_kernels.kda.kernel_tpu import Layout

_ELEMENTWISE = {"add", "sub", "mul", "neg", "select_n", "max", "min", "div"}


def _count(jaxpr) -> dict[str, float]:
  """Matmul flops (2 x output size x contraction), exp calls and elementwise ops (output
  sizes) over a closed jaxpr, recursing into sub-jaxprs."""
  out = dict(mm=0.0, exp=0.0, elem=0.0)
  for eqn in jaxpr.eqns:
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      for key, val in _count(sub).items():
        out[key] += val
    size = float(np.prod(eqn.outvars[0].aval.shape)) if eqn.outvars else 0.0
    name = eqn.primitive.name
    if name == "dot_general":
      (lc, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      out["mm"] += 2 * size * float(np.prod([lhs[d] for d in lc]))
    elif name == "exp":
      out["exp"] += size
    elif name in _ELEMENTWISE:
      out["elem"] += size
  return out


def _chunk_inputs(K, V, nb, packed):
  blocks = lambda f: [jnp.zeros((SUB, f), jnp.float32) for _ in range(nb)]  # noqa: E731
  x = dict(q=blocks(K), k=blocks(K), v=blocks(V), g=blocks(K), beta=blocks(1))
  seg = blocks(1) if packed else None
  return x, jnp.zeros((V, K), jnp.float32), seg


@pytest.mark.parametrize("K,V,C,packed", [(128, 128, 64, False), (64, 32, 32, True)])
def test_forward_estimate_counts_the_kernel_math(K, V, C, packed):
  nb, prec = C // SUB, lax_precision("highest")
  x, St, seg = _chunk_inputs(K, V, nb, packed)
  fn = lambda x_, St_: chunk_apply(x_, St_, seg, nb=nb, lower_bound=-5.0, scale=0.1,  # noqa: E731
                                   prec=prec)
  counted = _count(jax.make_jaxpr(fn)(x, St).jaxpr)
  assert sum(cost.chunk_matmul_flops(K, V, nb, packed).values()) == counted["mm"]
  assert cost.chunk_exps(K, nb) == counted["exp"]
  assert cost.chunk_elementwise(K, V, nb) == pytest.approx(counted["elem"], rel=0.35)
  # The pl.CostEstimate scales the per-chunk count by chunks x heads.
  lay = Layout(B=2, tp=4 * C, H=2, HV=2, K=K, V=V, stride=2)
  est = cost.forward_estimate(lay, TpuConfig(chunk_size=C), jnp.bfloat16, jnp.bfloat16,
                              jnp.float32, jnp.bfloat16, packed=packed, save_states=True)
  chunks = 2 * 2 * 4
  elem = cost.chunk_elementwise(K, V, nb)
  assert est.flops == int(chunks * (counted["mm"] + elem))
  assert est.transcendentals == int(chunks * counted["exp"])


@pytest.mark.parametrize("stride", [1, 2])
def test_backward_estimate_counts_the_vjp(stride):
  K, V, C, packed = 64, 32, 32, True
  nb, prec = C // SUB, lax_precision("highest")
  x, St, seg = _chunk_inputs(K, V, nb, packed)
  fn = lambda x_, St_: chunk_apply(x_, St_, seg, nb=nb, lower_bound=-5.0, scale=0.1,  # noqa: E731
                                   prec=prec)

  def step(x_, St_, do, dS):  # what the backward kernel runs per chunk
    _, vjp = jax.vjp(fn, x_, St_)
    return vjp((do, dS))

  do = [jnp.zeros((SUB, V), jnp.float32) for _ in range(nb)]
  per_chunk = _count(jax.make_jaxpr(step)(x, St, do, St).jaxpr)
  fwd = _count(jax.make_jaxpr(fn)(x, St).jaxpr)
  mm = per_chunk["mm"] + fwd["mm"] * (stride - 1) / stride  # + the state recompute
  lay = Layout(B=1, tp=4 * C, H=1, HV=1, K=K, V=V, stride=stride)
  est = cost.backward_estimate(lay, TpuConfig(chunk_size=C, state_stride=stride),
                               jnp.float32, jnp.float32, jnp.float32, jnp.float32,
                               packed=packed)
  elem = est.flops / 4 - (mm - 0)  # the estimate's elementwise part per chunk
  assert est.flops / 4 - cost.chunk_elementwise(K, V, nb) * (3 + (stride - 1) / stride) \
      == pytest.approx(mm, rel=1e-9)
  assert elem > 0
  assert est.transcendentals / 4 == pytest.approx(
      fwd["exp"] * (1 + (stride - 1) / stride), rel=1e-9)
