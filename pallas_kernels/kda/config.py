"""Block-size configs of the KDA kernels (one frozen dataclass per backend) and heuristics.

Untuned: no accelerator was available when these were written (see README.md). The
heuristics only keep the kernels inside their hard limits (Triton tensors must be powers of
two; a dot needs every dim >= 16) and pick the matmul precision from the input dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Precision = Literal["highest", "default"]
SUPPORTED_CHUNKS = (16, 32, 64)
SUPPORTED_DIMS = (16, 32, 64, 128, 256)


def lax_precision(name: Precision) -> jax.lax.Precision:
  return {"highest": jax.lax.Precision.HIGHEST, "default": jax.lax.Precision.DEFAULT}[name]


def _check(chunk_size: int, precision: str) -> None:
  if chunk_size not in SUPPORTED_CHUNKS:
    raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNKS}, got {chunk_size}")
  if precision not in ("highest", "default"):
    raise ValueError(f"precision must be 'highest' or 'default', got {precision!r}")


@dataclasses.dataclass(frozen=True)
class TpuConfig:
  """Mosaic TPU: grid (B, HV, N chunks), chunk axis sequential, whole V per program.

  precision: matmul precision; "highest" = fp32 contract precision (the cumsum and the
  16 x 16 inverses are always "highest"). Mosaic offers only DEFAULT and HIGHEST.
  fused: forward as one kernel (True) or as XLA chunk_prep + a Pallas recurrence (False).
  state_stride: chunks per state saved for the backward (the forward writes the state
    entering every stride-th chunk, f32 [V, K] per head; the backward's grid step covers
    stride chunks and recomputes the states between). Larger: less memory (HBM residual
    N / stride states), a longer unrolled backward body and (stride - 1) / stride extra
    forward work.
  """

  chunk_size: int = 64
  precision: Precision = "highest"
  fused: bool = True
  state_stride: int = 2

  def __post_init__(self):
    _check(self.chunk_size, self.precision)
    if self.state_stride not in (1, 2, 4):
      raise ValueError(f"state_stride must be 1, 2 or 4, got {self.state_stride}")


@dataclasses.dataclass(frozen=True)
class GpuConfig:
  """Pallas Triton: one program per (B, HV, V // block_v), chunks walked in a fori_loop.

  precision: "highest" = IEEE fp32 dots, "default" = TF32 tensor cores (fla's choice for
  its fp32-accumulated score and state products). The cumsum and 16 x 16 inverses are
  always IEEE. fused: forward as one kernel (True) or as XLA chunk_prep + a Pallas
  recurrence over chunks (False: chunk-parallel work at full occupancy, more HBM traffic).
  """

  chunk_size: int = 64
  block_v: int = 64
  num_warps: int = 4
  num_stages: int = 1
  precision: Precision = "highest"
  fused: bool = True

  def __post_init__(self):
    _check(self.chunk_size, self.precision)
    if self.block_v not in SUPPORTED_DIMS:
      raise ValueError(f"block_v must be one of {SUPPORTED_DIMS}, got {self.block_v}")


def default_tpu_config(*, chunk_size: int, dtype) -> TpuConfig:
  # Mosaic's DEFAULT f32 matmul may run as one bf16 pass; the anchored score factors
  # reach e^37.5 and need more than 8 mantissa bits, so stay at HIGHEST until measured.
  del dtype
  return TpuConfig(chunk_size=chunk_size, precision="highest")


def default_gpu_config(*, chunk_size: int, k: int, v: int, dtype) -> GpuConfig:
  # By ptxas's report for sm_90 (benchmarks/kda_gpu_aot.py, BENCHMARKS.md): the fused forward
  # spills at K = 128 with any tile (its per-chunk solves and the state share one program),
  # the split forward does not: chunk_prep in XLA, then a states pass (value tiles of
  # kernel_gpu.STATE_BV = 8, whatever block_v) and chunk-parallel output and gradient kernels
  # over value tiles of block_v = 16.
  del k
  block_v = min(v, 16)
  precision = "highest" if jnp.dtype(dtype) == jnp.float32 else "default"
  return GpuConfig(chunk_size=chunk_size, block_v=block_v, num_warps=4, num_stages=1,
                   precision=precision, fused=False)


# Compiled for v5p by libtpu 0.0.42.1 (deviceless AOT, C=64, packed, fwd and fwd+bwd): K or
# V = 256 fails with CompileTimeScopedVmemOom (K, V in {64, 128, 256} x 256 tried), 128 x 128
# compiles. So on TPU the kernel's domain stops at 128.
TPU_MAX_DIM = 128


def check_domain_dims(K: int, V: int, *, lower_bound: float | None, chunk_size: int,
                      backend: str) -> None:
  """Raises NotImplementedError for valid inputs the kernels do not cover (another
  implementation handles them), from the static properties alone (head dims K, V; no
  arrays), so a caller can say which implementation a layer runs before tracing it.
  backend: "tpu" or "gpu", the kernel asked about."""
  if lower_bound is None:
    raise NotImplementedError(
        "the KDA Pallas kernel needs the bounded gate (lower_bound in [-5, 0)): its "
        "16-token diagonal blocks are one matmul with factors up to e^(7.5 |lb|), which "
        "unbounded gates overflow; use impl='chunked' for unbounded gates"
    )
  if K not in SUPPORTED_DIMS or V not in SUPPORTED_DIMS:
    raise NotImplementedError(
        f"the KDA Pallas kernel supports head dims K, V in {SUPPORTED_DIMS} (powers of "
        f"two: Triton tensor shapes; >= 16: dot tiles), got K={K}, V={V}"
    )
  if backend == "tpu" and max(K, V) > TPU_MAX_DIM:
    raise NotImplementedError(
        f"the TPU KDA kernel's blocks exceed the scoped VMEM for head dims > {TPU_MAX_DIM} "
        f"(libtpu: CompileTimeScopedVmemOom), got K={K}, V={V}")
  if chunk_size not in SUPPORTED_CHUNKS:
    raise NotImplementedError(
        f"the KDA Pallas kernel supports chunk_size in {SUPPORTED_CHUNKS}, got {chunk_size}"
    )
