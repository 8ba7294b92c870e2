"""The KDA contract, run against every implementation of the op's table (`ops.kda.TABLE`):
output and final-state shapes and dtypes, packed segments, grouped heads, odd lengths, the
forward and every gradient against the exact token recurrence.

The Pallas rows run natively on their own platform and interpreted elsewhere (on CPU: both
kernels in interpret mode); a case outside a kernel's domain (unbounded gate, head dims)
is skipped with the kernel's own reason (`check_domain_dims`). Kernel-only checks (block
configs, extreme gates, causality to the bit) live in tests/pallas/test_kda_kernels.py.
Tolerances: fp32 inputs 1e-5 relative RMS; bf16 inputs fla's (0.005 outputs/state, 0.008
dq/dk/dv/dh0, 0.02 dg/dbeta).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe_jax.ops.kda import TABLE
from pallas_kernels.kda import check_domain_dims
from tests._support import assert_close

PLATFORM = jax.default_backend()
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
F32_TOL = dict.fromkeys(("o", "ht") + GRAD_NAMES, 1e-5)
BF16_TOL = dict(o=0.005, ht=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, dbeta=0.02,
                dh0=0.008)


def make_inputs(seed, B, T, H, HV, K, V, lower_bound=-5.0, dtype=jnp.float32):
  """q, k (L2-normalised), v, beta in dtype; g float32, bounded in (lb, 0) or unbounded
  (-softplus: mostly slow decays, a tail of fast ones); h0, do, dht float32."""
  rng = np.random.default_rng(seed)
  l2 = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  q, k = l2(rng.normal(size=(B, T, H, K))), l2(rng.normal(size=(B, T, H, K)))
  v = rng.normal(size=(B, T, HV, V))
  x = 2.0 * rng.normal(size=(B, T, HV, K))
  g = (-np.logaddexp(0.0, x - 2.0) if lower_bound is None
       else lower_bound / (1.0 + np.exp(-x)))
  beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(B, T, HV))))
  h0, dht = rng.normal(size=(B, HV, K, V)), rng.normal(size=(B, HV, K, V))
  do = rng.normal(size=(B, T, HV, V))
  cast = lambda a, dt: jnp.asarray(a, jnp.float32).astype(dt)  # noqa: E731
  return (cast(q, dtype), cast(k, dtype), cast(v, dtype), cast(g, jnp.float32),
          cast(beta, dtype), cast(h0, jnp.float32), cast(do, dtype), cast(dht, jnp.float32))


def packed_ids(B: int, T: int, C: int) -> np.ndarray:
  """[B, T] int32 ids of packed documents: starts at token 1, at a chunk boundary, inside a
  16-block, one-token documents and the last token (row 0); random starts (row 1). Ids are
  unsorted: only changes matter."""
  rng = np.random.default_rng(T + C)
  starts = np.zeros((B, T), bool)
  for t in (1, C, C + 5, C + 6, 2 * C + 3, T - 1):
    if t < T:
      starts[0, t] = True
  starts[1:, 1:] = rng.random((B - 1, T - 1)) < 0.08
  return (np.cumsum(starts, axis=1) * 7 % 11).astype(np.int32)


@functools.lru_cache(maxsize=None)
def fwd_bwd(name, use_h0, packed, chunk_size, lower_bound):
  """Jitted (o, ht, grads) of L = sum(o * do) + sum(ht * dht) through TABLE[name]."""
  row = TABLE[name]

  def loss(q, k, v, g, beta, h0, do, dht, seg):
    o, ht = row.run(q, k, v, g, beta, scale=None, initial_state=h0 if use_h0 else None,
                    output_final_state=True, segment_ids=seg if packed else None,
                    chunk_size=chunk_size, lower_bound=lower_bound,
                    interpret=PLATFORM not in row.platforms)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht * dht), (o, ht)

  grad = jax.value_and_grad(loss, (0, 1, 2, 3, 4, 5) if use_h0 else (0, 1, 2, 3, 4),
                            has_aux=True)

  @jax.jit
  def run(*args):
    (_, (o, ht)), grads = grad(*args)
    return o, ht, grads

  return run


# (T, C, H, HV, K, V, h0, lower_bound, packed, dtype): every listed length (one token, odd,
# several chunks and scan steps), chunk size, head grouping, gate kind and dtype appears,
# without the full product. Unbounded gates and K or V < 16 are XLA-only (Pallas: skipped).
CASES = [
    (1, 16, 2, 2, 16, 16, False, None, False, jnp.float32),
    (15, 32, 1, 2, 16, 32, True, -5.0, False, jnp.float32),
    (37, 16, 2, 4, 32, 16, True, -5.0, True, jnp.float32),
    (63, 32, 2, 4, 16, 32, True, None, False, jnp.float32),
    (70, 64, 1, 2, 32, 32, False, -3.0, True, jnp.float32),
    (100, 32, 1, 2, 32, 32, True, -5.0, True, jnp.bfloat16),
    (200, 16, 1, 2, 16, 32, True, None, True, jnp.float32),
    pytest.param(200, 64, 2, 4, 8, 8, False, None, False, jnp.float32,
                 marks=pytest.mark.slow),
    pytest.param(500, 32, 2, 4, 16, 16, False, -5.0, True, jnp.float32,
                 marks=pytest.mark.slow),
    pytest.param(600, 16, 1, 2, 16, 32, True, None, True, jnp.float32,
                 marks=pytest.mark.slow),
]
IMPLS = [name for name in TABLE if name != "recurrent"] + ["recurrent"]


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("T,C,H,HV,K,V,use_h0,lb,packed,dtype", CASES)
def test_matches_the_token_recurrence(T, C, H, HV, K, V, use_h0, lb, packed, dtype, name):
  if name.startswith("pallas_"):
    try:
      check_domain_dims(K, V, lower_bound=lb, chunk_size=C, backend=name[len("pallas_"):])
    except NotImplementedError as e:
      pytest.skip(f"{name}: {e}")
  B = 2
  inputs = make_inputs(T + C + K, B, T, H, HV, K, V, lb, dtype)
  seg = jnp.asarray(packed_ids(B, T, C))
  out = fwd_bwd(name, use_h0, packed, C, lb)(*inputs, seg)
  # The reference sees the same (dtype-rounded) inputs, in fp32.
  ref = fwd_bwd("recurrent", use_h0, packed, C, lb)(
      *(x.astype(jnp.float32) for x in inputs), seg)
  assert out[0].dtype == dtype and out[0].shape == (B, T, HV, V)
  assert out[1].dtype == jnp.float32 and out[1].shape == (B, HV, K, V)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  assert_close(out[0].astype(jnp.float32), ref[0], tol["o"], "o")
  assert_close(out[1], ref[1], tol["ht"], "ht")
  for what, d, d_ref, x in zip(GRAD_NAMES, out[2], ref[2], inputs):
    assert d.dtype == x.dtype and d.shape == x.shape, what
    assert_close(d.astype(jnp.float32), d_ref, tol[what], what)
