"""Public entry point of the KDA Pallas kernels: `kda_pallas`.

Conventions (DESIGN s1): q, k [B, T, H, K] L2-normalised; v [B, T, HV, V]; g [B, T, HV, K]
log decay in [lower_bound, 0]; beta [B, T, HV]; state [B, HV, K, V] float32.
Domain errors raise NotImplementedError (so `kda(impl="auto")` falls back to XLA); invalid
arguments raise ValueError.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from hybridmoe_jax.ops.decay import check_lower_bound
from hybridmoe_jax.ops.kda.recurrent import check_kda_inputs
from hybridmoe_jax.ops.platform import target_platform

from .config import (
    SUPPORTED_CHUNKS,
    SUPPORTED_DIMS,
    GpuConfig,
    TpuConfig,
    default_gpu_config,
    default_tpu_config,
)
from .segments import chunk_local_segments
from .wrapper import Static, kda_core, padded_length

Backend = Literal["auto", "tpu", "gpu"]
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _resolve_backend(backend: str, interpret: bool | None) -> tuple[str, bool]:
  # The platform the program is compiled for (the active mesh's devices, else the host's),
  # so an ahead-of-time compile for a TPU topology on a CPU host gets the Mosaic kernel.
  platform, _ = target_platform()
  if backend not in ("auto", "tpu", "gpu"):
    raise ValueError(f"backend must be 'auto', 'tpu' or 'gpu', got {backend!r}")
  if interpret is None:
    interpret = platform not in ("tpu", *_GPU_PLATFORMS)
  if backend == "auto":
    backend = "tpu" if platform == "tpu" else "gpu"
  native = {"tpu": ("tpu",), "gpu": _GPU_PLATFORMS}[backend]
  if not interpret and platform not in native:
    raise NotImplementedError(
        f"the {backend} KDA kernel cannot run natively on platform {platform!r}; "
        "pass interpret=True to interpret it"
    )
  return backend, bool(interpret)


def check_domain(q, v, *, lower_bound, chunk_size) -> None:
  """Raises NotImplementedError for inputs the kernels do not cover (valid arguments
  that another implementation handles)."""
  check_domain_dims(q.shape[-1], v.shape[-1], lower_bound=lower_bound, chunk_size=chunk_size)


# Compiled for v5p by libtpu 0.0.42.1 (deviceless AOT, C=64, packed, fwd and fwd+bwd): K or
# V = 256 fails with CompileTimeScopedVmemOom (K, V in {64, 128, 256} x 256 tried), 128 x 128
# compiles. So on TPU the kernel's domain stops at 128.
TPU_MAX_DIM = 128


def check_domain_dims(K: int, V: int, *, lower_bound, chunk_size,
                      backend: str | None = None) -> None:
  """`check_domain` from the static properties alone (head dims K, V; no arrays), so a
  caller can say which implementation a layer will run before tracing it. `backend`
  ("tpu"): also the limits of compiling for that platform (the chooser passes it)."""
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


def kda_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    lower_bound: float | None = None,
    backend: Backend = "auto",
    interpret: bool | None = None,
    config: TpuConfig | GpuConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Kimi Delta Attention (arXiv:2510.26692) with bounded gates, as a Pallas kernel.

  Per token: S <- diag(e^g) S; S <- S + beta k (v - k^T S)^T; o = scale q^T S, computed
  chunkwise (DESIGN s1.1-1.2); differentiable (custom_vjp) in q, k, v, g, beta and the
  initial state.

  Args:
    q, k: [B, T, H, K] L2-normalised queries/keys (float32 / bfloat16 / float16).
    v: [B, T, HV, V] values, HV a multiple of H.
    g: [B, T, HV, K] log decay in [lower_bound, 0] (float32 recommended).
    beta: [B, T, HV] write strength.
    scale: query scale; defaults to K ** -0.5.
    initial_state: optional [B, HV, K, V] state (float32).
    output_final_state: also return the final state.
    segment_ids: optional [B, T] integer ids of packed documents: the state resets where
      the id changes (token 0 keeps initial_state) and documents never interact. None
      compiles the unpacked kernels, with no segment masks.
    chunk_size: C in (16, 32, 64).
    lower_bound: the bounded gate's lb in [-5, 0); required.
    backend: "tpu" (Mosaic), "gpu" (Triton) or "auto" (from jax.default_backend(); the
      GPU kernel when interpreting on CPU).
    interpret: run the kernels with interpret=True; default: on CPU only.
    config: block sizes (TpuConfig / GpuConfig for the chosen backend); default heuristic.

  Returns:
    (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] float32 or None).

  Raises:
    ValueError: bad shapes, lower_bound, backend or config.
    NotImplementedError: unbounded gates (lower_bound None), unsupported head dims or
      chunk size, or a backend that cannot run on this platform.
  """
  check_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
  check_domain(q, v, lower_bound=lower_bound, chunk_size=chunk_size)
  check_lower_bound(lower_bound)
  backend, interpret = _resolve_backend(backend, interpret)
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  if config is None:
    config = (default_tpu_config(chunk_size=chunk_size, dtype=q.dtype) if backend == "tpu"
              else default_gpu_config(chunk_size=chunk_size, k=K, v=V, dtype=q.dtype))
  expected = TpuConfig if backend == "tpu" else GpuConfig
  if not isinstance(config, expected) or config.chunk_size != chunk_size:
    raise ValueError(f"config must be a {expected.__name__} with chunk_size={chunk_size}, "
                     f"got {config!r}")
  if isinstance(config, GpuConfig) and V % config.block_v:
    raise ValueError(f"block_v={config.block_v} must divide V={V}")
  st = Static(backend=backend, cfg=config, scale=float(K**-0.5 if scale is None else scale),
              lower_bound=float(lower_bound), interpret=interpret)
  h0 = jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None else initial_state
  seg = None
  if segment_ids is not None:  # padding tokens continue the last segment (segments.py)
    tp = padded_length(T, backend, config)
    seg = chunk_local_segments(jnp.pad(segment_ids, ((0, 0), (0, tp - T)), mode="edge"),
                               chunk_size)
  o, ht = kda_core(q, k, v, g, beta, h0, seg, st)
  return o, (ht if output_final_state else None)
