"""KDA Pallas kernels (pallas_kernels/kda) vs the token recurrence, in interpret mode on CPU:
what the op's contract test (tests/ops/test_kda_contract.py, default configs) does not
cover: block configs (split forward, value tiles, TF32), head dims 128, causality to the
bit, extreme gates and keys, the kernels' domain and argument errors. Native lowering
without a device: test_kda_lowering.py; inside the model: test_model_pallas.py.

Set KDA_PALLAS_NATIVE=1 on a GPU/TPU machine to run the same checks compiled (interpret=False,
the backend of the machine only). Tolerances: fp32 inputs 1e-5 relative RMS; bf16 inputs
fla's (0.005 outputs/state, 0.008 dq/dk/dv/dh0, 0.02 dg/dbeta).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe_jax.ops.kda import kda
from hybridmoe_jax.ops.kda.chunked import kda_chunked
from hybridmoe_jax.ops.kda.recurrent import kda_recurrent
from pallas_kernels.kda import GpuConfig, TpuConfig, check_domain_dims, kda_pallas
from tests._support import assert_close
from tests.ops.test_kda_contract import make_inputs  # bounded gates (lb -5) by default

NATIVE = os.environ.get("KDA_PALLAS_NATIVE", "0") == "1"
PLATFORM = jax.default_backend()
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
F32_TOL = dict(o=1e-5, ht=1e-5, dq=1e-5, dk=1e-5, dv=1e-5, dg=1e-5, dbeta=1e-5, dh0=1e-5)
BF16_TOL = dict(o=0.005, ht=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, dbeta=0.02,
                dh0=0.008)


@functools.lru_cache(maxsize=None)
def fwd_bwd(impl, use_h0):
  """Jitted (o, ht, grads) of L = sum(o * do) + sum(ht * dht); impl(q..beta, h0) -> (o, ht)."""

  def loss(q, k, v, g, beta, h0, do, dht):
    o, ht = impl(q, k, v, g, beta, h0 if use_h0 else None)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht * dht), (o, ht)

  argnums = (0, 1, 2, 3, 4, 5) if use_h0 else (0, 1, 2, 3, 4)

  @jax.jit
  def run(*args):
    (_, (o, ht)), grads = jax.value_and_grad(loss, argnums, has_aux=True)(*args)
    return o, ht, grads

  return run


def recurrent(q, k, v, g, beta, h0):
  return kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)


@functools.lru_cache(maxsize=None)
def pallas(backend, chunk_size=64, config=None):
  if NATIVE and backend != ("tpu" if PLATFORM == "tpu" else "gpu"):
    pytest.skip(f"{backend} kernel cannot run natively on {PLATFORM}")

  def run(q, k, v, g, beta, h0):
    return kda_pallas(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                      chunk_size=chunk_size, lower_bound=-5.0, backend=backend,
                      interpret=not NATIVE, config=config)

  return run


def _f32(x):
  return jnp.asarray(x).astype(jnp.float32)


# (T, K, V, H, HV, h0, dtype, backend, chunk, config): the block configs (the default ones
# run in the contract test); GpuConfig(block_v=32) with V = 64 runs two value tiles per head; precision="default" is
# TF32 on a GPU (full fp32 when interpreted on CPU); fused=False is the split forward (XLA
# chunk_prep + the Pallas recurrence).
CASES = [
    (256, 32, 32, 1, 2, False, jnp.float32, "tpu", 64, TpuConfig(fused=False)),
    (64, 32, 32, 1, 1, True, jnp.float32, "gpu", 64, GpuConfig(block_v=16, fused=False)),
    (64, 64, 64, 2, 2, True, jnp.float32, "gpu", 16, GpuConfig(chunk_size=16, block_v=32)),
    (256, 64, 64, 1, 1, True, jnp.bfloat16, "gpu", 64,
     GpuConfig(block_v=32, precision="default")),
    # The benchmark head size with the default (heuristic) config: TF32 dots on a GPU.
    (64, 128, 128, 1, 2, False, jnp.bfloat16, "gpu", 64, None),
]


@pytest.mark.parametrize("T,K,V,H,HV,use_h0,dtype,backend,chunk,config", CASES)
def test_kernel_matches_recurrent(T, K, V, H, HV, use_h0, dtype, backend, chunk, config):
  q, k, v, g, beta, h0, do, dht = make_inputs(T + K + V, 2, T, H, HV, K, V, dtype=dtype)
  out = fwd_bwd(pallas(backend, chunk, config), use_h0)(q, k, v, g, beta, h0, do, dht)
  # The reference sees the same (dtype-rounded) inputs, in fp32.
  ref_in = [_f32(x) for x in (q, k, v, g, beta, h0, do, dht)]
  ref = fwd_bwd(recurrent, use_h0)(*ref_in)
  assert out[0].dtype == dtype and out[0].shape == (2, T, HV, V)
  assert out[1].dtype == jnp.float32 and out[1].shape == (2, HV, K, V)
  _assert_fwd_bwd_close(out, ref, dtype, (q, k, v, g, beta, h0))


def _assert_fwd_bwd_close(out, ref, dtype, inputs) -> None:
  """Kernel (o, ht, grads) vs the fp32 token scan's, at the dtype's tolerances; every
  gradient keeps its input's dtype."""
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  assert_close(_f32(out[0]), ref[0], tol["o"], "o")
  assert_close(out[1], ref[1], tol["ht"], "ht")
  for name, d, d_ref, x in zip(GRAD_NAMES, out[2], ref[2], inputs):
    assert d.dtype == x.dtype, name
    assert_close(_f32(d), d_ref, tol[name], name)


def packed_ids(B: int, T: int, C: int) -> jax.Array:
  """[B, T] int32 segment ids of packed documents. Row 0: starts at token 1, at the chunk
  boundaries C and 2C, inside chunks, a one-token document (C + 5) and a start at the last
  token; row 1: a run of one-token documents inside one 16-block, then random starts;
  row 2 (if B > 2): one document. Ids are arbitrary (not sorted): only changes matter."""
  rng = np.random.default_rng(T + C)
  starts = np.zeros((B, T), bool)
  for t in (1, C, C + 5, C + 6, 2 * C, 2 * C + C // 2 + 3, T - 1):
    if t < T:
      starts[0, t] = True
  starts[1, 19:24] = True
  starts[1, 24:] = rng.random(T - 24) < 0.08
  ids = np.cumsum(starts, axis=1) * 7 % 11  # distinct neighbours, unsorted values
  return jnp.asarray(ids, jnp.int32)


def recurrent_packed(segment_ids):
  def run(q, k, v, g, beta, h0):
    return kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         segment_ids=segment_ids)
  return run


def pallas_packed(backend, chunk_size, config, segment_ids):
  if NATIVE and backend != ("tpu" if PLATFORM == "tpu" else "gpu"):
    pytest.skip(f"{backend} kernel cannot run natively on {PLATFORM}")

  def run(q, k, v, g, beta, h0):
    return kda_pallas(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                      segment_ids=segment_ids, chunk_size=chunk_size, lower_bound=-5.0,
                      backend=backend, interpret=not NATIVE, config=config)

  return run


# (T, K, V, H, HV, h0, dtype, backend, chunk, config): packed batches (packed_ids) through
# the block configs of both backends, the split forward and bf16.
PACKED_CASES = [
    (150, 32, 32, 1, 1, False, jnp.float32, "gpu", 64, GpuConfig(block_v=16)),
    (128, 32, 32, 1, 2, True, jnp.float32, "gpu", 64, GpuConfig(block_v=32, fused=False)),
    (96, 32, 32, 1, 1, True, jnp.float32, "tpu", 32, TpuConfig(chunk_size=32, fused=False)),
    (128, 64, 64, 1, 2, True, jnp.bfloat16, "gpu", 32,
     GpuConfig(chunk_size=32, block_v=32, precision="default")),
]


@pytest.mark.parametrize("T,K,V,H,HV,use_h0,dtype,backend,chunk,config", PACKED_CASES)
def test_packed_kernel_matches_recurrent(T, K, V, H, HV, use_h0, dtype, backend, chunk,
                                         config):
  """Packed documents (state resets, no attention across documents, restarted decays):
  outputs, final state and all gradients equal the token scan with segment_ids."""
  B = 3 if T == 150 else 2
  q, k, v, g, beta, h0, do, dht = make_inputs(T + K + V + 1, B, T, H, HV, K, V, dtype=dtype)
  seg = packed_ids(B, T, chunk)
  out = fwd_bwd(pallas_packed(backend, chunk, config, seg), use_h0)(
      q, k, v, g, beta, h0, do, dht)
  ref_in = [_f32(x) for x in (q, k, v, g, beta, h0, do, dht)]
  ref = fwd_bwd(recurrent_packed(seg), use_h0)(*ref_in)
  assert out[0].dtype == dtype and out[0].shape == (B, T, HV, V)
  _assert_fwd_bwd_close(out, ref, dtype, (q, k, v, g, beta, h0))


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_anchor_is_causal(backend):
  """Changing a future token's gate leaves every earlier output bit-identical, also inside
  the same 16-token diagonal block (token 37: block rows 32..47 of chunk 0)."""
  q, k, v, g, beta, h0, _, _ = make_inputs(3, 1, 100, 1, 2, 32, 32)
  m = 37
  g2 = g.at[:, m].set(-4.9)
  run = jax.jit(lambda g_: pallas(backend)(q, k, v, g_, beta, h0)[0])
  o1, o2 = np.asarray(run(g)), np.asarray(run(g2))
  np.testing.assert_array_equal(o1[:, :m], o2[:, :m])
  assert not np.array_equal(o1[:, m:], o2[:, m:])


def test_extreme_gates_stay_finite():
  """Every gate at the bound (-5) or at ~0: the largest anchored factors (e^37.5) and the
  fastest decays (e^-320 per chunk) in one run; outputs and gradients stay finite and
  match the recurrence."""
  q, k, v, g, beta, h0, do, dht = make_inputs(4, 1, 64, 1, 1, 32, 32)
  rng = np.random.default_rng(0)
  g = jnp.asarray(np.where(rng.random(g.shape) < 0.5, -5.0, -1e-6), jnp.float32)
  out = fwd_bwd(pallas("gpu"), True)(q, k, v, g, beta, h0, do, dht)
  ref = fwd_bwd(recurrent, True)(q, k, v, g, beta, h0, do, dht)
  assert_close(out[0], ref[0], 2e-5, "o")
  for name, d, d_ref in zip(GRAD_NAMES, out[2], ref[2]):
    assert_close(d, d_ref, 2e-5, name)


def test_identical_keys_worst_conditioned_inverse():
  """All keys equal, gates ~0, beta ~1: L ~ strict ones, the worst case of the 16 x 16
  Neumann product (L^8 entries up to 3432, cancelling to an inverse bounded by 1). With the
  Newton refinement the kernel and its gradients stay at fp32 accuracy (the plain product
  alone gives ~1e-4 on outputs and ~1e-3 on gradients here)."""
  q, k, v, g, beta, h0, do, dht = make_inputs(9, 1, 64, 1, 1, 32, 32)
  k = jnp.broadcast_to(k[:, :1], k.shape)
  g = jnp.full_like(g, -1e-6)
  beta = jnp.full_like(beta, 0.999)
  out = fwd_bwd(pallas("gpu"), True)(q, k, v, g, beta, h0, do, dht)
  ref = fwd_bwd(recurrent, True)(q, k, v, g, beta, h0, do, dht)
  assert_close(out[0], ref[0], 2e-5, "o")
  assert_close(out[1], ref[1], 2e-5, "ht")
  for name, d, d_ref in zip(GRAD_NAMES, out[2], ref[2]):
    assert_close(d, d_ref, 2e-5, name)


# --- dispatcher and domain errors ----------------------------------------------------------


def test_dispatcher_pallas_matches_chunked():
  """kda(impl="pallas") runs the kernel (interpreted on CPU) and equals the XLA path."""
  q, k, v, g, beta, h0, _, _ = make_inputs(5, 1, 40, 1, 2, 16, 16)
  kw = dict(initial_state=h0, output_final_state=True, chunk_size=16, lower_bound=-5.0)
  o, ht = jax.jit(functools.partial(kda, impl="pallas", **kw))(q, k, v, g, beta)
  o_ref, ht_ref = kda_chunked(q, k, v, g, beta, **kw)
  assert_close(o, o_ref, 1e-5, "o")
  assert_close(ht, ht_ref, 1e-5, "ht")


def test_auto_falls_back_for_unbounded_gate(monkeypatch):
  """On an accelerator, auto tries the kernel; unbounded gates make it fall back to XLA."""
  q, k, v, g, beta, _, _, _ = make_inputs(6, 1, 20, 1, 1, 16, 16)
  expected = kda_chunked(q, k, v, g, beta)[0]
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  np.testing.assert_array_equal(kda(q, k, v, g, beta, impl="auto")[0], expected)


def _small(**over):
  q, k, v, g, beta, h0, _, _ = make_inputs(8, 1, 20, 1, 2, 16, 16)
  kw = dict(q=q, k=k, v=v, g=g, beta=beta, lower_bound=-5.0)
  kw.update(over)
  return [kw.pop(n) for n in ("q", "k", "v", "g", "beta")], kw


@pytest.mark.parametrize("over,match", [
    (dict(lower_bound=None), "needs the bounded gate"),
    (dict(K=48), r"head dims K, V in \(16, 32, 64, 128, 256\)"),
    (dict(V=8), "K=16, V=8"),
    (dict(V=256, backend="tpu"), "scoped VMEM"),
    (dict(chunk_size=128), "chunk_size in"),
])
def test_kernel_domain_errors(over, match):
  kw = dict(K=16, V=16, lower_bound=-5.0, chunk_size=64, backend="gpu") | over
  with pytest.raises(NotImplementedError, match=match):
    check_domain_dims(kw.pop("K"), kw.pop("V"), **kw)


@pytest.mark.parametrize("over,match", [
    (dict(backend="cuda"), "backend must be"),
    (dict(config=TpuConfig(), backend="gpu"), "config must be a GpuConfig"),
    (dict(config=GpuConfig(chunk_size=32), backend="gpu"), "chunk_size=64"),
])
def test_kda_pallas_value_errors(over, match):
  args, kw = _small(**over)
  with pytest.raises(ValueError, match=match):
    kda_pallas(*args, interpret=True, **kw)


@pytest.mark.parametrize("over,match", [
    (dict(lower_bound=None), "needs the bounded gate"),
    (dict(chunk_size=128), "chunk_size in"),
])
def test_dispatcher_domain_errors(over, match):
  """Explicit impl="pallas" raises NotImplementedError outside the kernel's domain (never
  silently computes something else); impl="auto" falls back on the same inputs."""
  args, kw = _small(**over)
  with pytest.raises(NotImplementedError, match=match):
    kda(*args, impl="pallas", **kw)
