"""Native (not interpreted) lowering of the KDA Pallas kernels, with no device.

On a CPU-only jaxlib, `jax.jit(f).trace(...).lower(lowering_platforms=(p,))` runs Pallas's
Triton (p = "cuda") or Mosaic (p = "tpu") front end on the forward and backward kernels:
it catches primitives, block shapes and dtypes a backend cannot lower, long before a device
is available. What it cannot check: Triton -> PTX compilation, Mosaic's layout passes and
run time (they need the device).

Mosaic asks for the TPU generation while lowering: from the abstract mesh's device if one
is set, else from the local device; on CPU the latter raises "Unsupported TPU device kind:
cpu" (test_tpu_lowering_needs_a_tpu_device_kind). So the TPU checks lower under an abstract
mesh whose abstract device is a TPU v6e (public jax.sharding API; README.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda.config import (
    SUPPORTED_CHUNKS,
    SUPPORTED_DIMS,
    default_gpu_config,
    default_tpu_config,
)
from pallas_kernels.kda.api import Static, kda_core

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_sd = jax.ShapeDtypeStruct


def _grid():
  """A rotating subset of the product (test_kernels_lower_full_product, slow, has all of it):
  6 cases per chunk, case j with dtype j % 3 and packed iff j >= 3, so each chunk meets every
  (dtype, packed) pair; K and V rotate the other way per chunk, so each chunk meets every K
  and every V, and across the chunks each K and each V meets every dtype and both packings."""
  n = len(SUPPORTED_DIMS)
  for ci, C in enumerate(SUPPORTED_CHUNKS):
    for j in range(6):
      yield (C, SUPPORTED_DIMS[(j + ci) % n], SUPPORTED_DIMS[(j - ci + 2) % n], DTYPES[j % 3],
             j >= 3)


GRID = list(_grid())
# The benchmark size both ways, and the split forward (XLA prep + Pallas recurrence).
EXTRA = [(64, 128, 128, jnp.bfloat16, False, True), (64, 128, 128, jnp.bfloat16, True, True),
         (16, 64, 32, jnp.float32, True, False), (64, 128, 128, jnp.bfloat16, True, False)]
CASES = [(*case, True) for case in GRID] + EXTRA


def _ids(case):
  C, K, V, dt, packed, fused = case
  return f"C{C}-K{K}-V{V}-{jnp.dtype(dt).name}-{'packed' if packed else 'unpacked'}" + (
      "" if fused else "-split")


def tpu_v6e():
  """Context in which Mosaic lowers for a TPU v6e (one TensorCore), whatever the host."""
  device = jax.sharding.AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def h100():
  """Context in which Pallas's Triton backend lowers for an H100, whatever the host (jax
  >= 0.12 reads the GPU generation from the abstract mesh's device, as Mosaic does)."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132,
                                       platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def lower(backend: str, C: int, K: int, V: int, dt, packed: bool, fused: bool = True) -> str:
  """StableHLO text of jit(value_and_grad(sum(o) + sum(ht))) through kda_core, forward and
  backward kernels lowered for the backend's platform (B = 1, T = 2C, H = 1, HV = 2). The
  value keeps the forward kernel live: with the gradient alone, jax 0.12 removes a forward
  whose outputs the backward does not read (the split forward's recurrence)."""
  cfg = (default_tpu_config(chunk_size=C, dtype=dt) if backend == "tpu"
         else default_gpu_config(chunk_size=C, k=K, v=V, dtype=dt))
  cfg = dataclasses.replace(cfg, fused=fused)
  st = Static(backend=backend, cfg=cfg, scale=K**-0.5, lower_bound=-5.0, interpret=False)
  B, T, H, HV = 1, 2 * C, 1, 2
  args = (_sd((B, T, H, K), dt), _sd((B, T, H, K), dt), _sd((B, T, HV, V), dt),
          _sd((B, T, HV, K), jnp.float32), _sd((B, T, HV), dt),
          _sd((B, HV, K, V), jnp.float32), _sd((B, T), jnp.float32) if packed else None)

  def loss(*a):
    o, ht = kda_core(*a, st)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

  platform = "tpu" if backend == "tpu" else "cuda"
  with contextlib.nullcontext() if backend == "tpu" else h100():
    return jax.jit(jax.value_and_grad(loss, argnums=range(6))).trace(*args).lower(
        lowering_platforms=(platform,)).as_text()


def _check(text: str, backend: str, packed: bool, fused: bool):
  target = "tpu_custom_call" if backend == "tpu" else "xla.gpu.triton"
  # GPU: the forward (fused: one kernel; split: states + chunk-parallel output), then the
  # backward's two slice loops (kernel_gpu.sliced_backward): the states pass (the state
  # entering each slice), then per slice the states pass again, the reverse state-gradient
  # and two chunk-parallel gradient kernels. TPU: the fused forward saves the states for the
  # one-kernel backward; the split forward needs the states kernel.
  expected = ((6 if fused else 7) if backend == "gpu"
              else (2 if fused else 3))
  assert text.count(target) == expected
  # The unpacked fast path compiles no segment masks: separate forward (and TPU backward)
  # kernels.
  assert ("kda_fwd_packed" in text) == (packed and fused)
  if backend == "tpu":
    assert ("kda_bwd_packed_tpu" in text) == packed


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gpu_kernels_lower(case):
  C, K, V, dt, packed, fused = case
  _check(lower("gpu", C, K, V, dt, packed, fused), "gpu", packed, fused)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_tpu_kernels_lower(case):
  C, K, V, dt, packed, fused = case
  with tpu_v6e():
    text = lower("tpu", C, K, V, dt, packed, fused)
  _check(text, "tpu", packed, fused)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="documents the CPU-only failure")
def test_tpu_lowering_needs_a_tpu_device_kind():
  """Why the TPU checks lower under tpu_v6e(): without an abstract TPU device Mosaic reads
  the TPU generation of the local device, and a CPU device has none. (If this starts to
  lower, tpu_v6e() is no longer needed.)"""
  with pytest.raises(ValueError, match="Unsupported TPU device kind: cpu"):
    lower("tpu", 16, 16, 16, jnp.float32, False)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernels_lower_full_product(backend):
  """Every (chunk, K, V, dtype, packed) combination (450 lowerings per backend)."""
  with tpu_v6e() if backend == "tpu" else contextlib.nullcontext():
    for C, K, V, dt, packed in itertools.product(SUPPORTED_CHUNKS, SUPPORTED_DIMS,
                                                 SUPPORTED_DIMS, DTYPES, (False, True)):
      _check(lower(backend, C, K, V, dt, packed), backend, packed, True)
