"""MLA training attention on accelerators: the kernels JAX ships, one resolver, one entry.

Every core here computes the same thing as `blockwise_attention.attention_reference` for
self-attention (Tq == Tk == T, q_offset 0): causal softmax attention within packed segments.
    q: [B, T, H, D]   k: [B, T, Hk, D]   v: [B, T, Hk, Dv]   (H a multiple of Hk)
    segment_ids: [B, T] int32 or None;  out: [B, T, H, Dv]
The cores ("dense", "blockwise" in XLA; "cudnn", "triton", "splash" kernels) are picked by
`resolve_impl`, a pure function of (impl, backend, shapes, dtype, has_segments) so that every
branch can be checked on any machine; `attend` runs the picked one.

  cudnn   `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`. Its public
          signature has no segment ids: packed documents could only be a dense [B, 1, T, T]
          mask (O(T^2) memory, the very thing a flash kernel avoids), so it takes unpacked
          input only. It needs q, k, v of one head dim: the wrapper zero-pads D and Dv to a
          common multiple of 8 (zero columns change no logit) and slices the output.
  triton  Pallas' GPU flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`): causal
          + segment ids, own backward. Needs equal head counts (k, v are repeated per group),
          one head dim (zero-padded as above) and T a multiple of its tiles (padded at the
          end: causality keeps every real query off the padded keys).
  splash  TPU splash attention: causal mask + segment ids, MQA form for one shared head
          (Hk = 1, the absorbed MLA), grouped form otherwise; tiles of 128 n tokens (T padded
          as above); no logit scale argument, so q is scaled first.
The Pallas modules are imported inside the wrappers: this module needs jax alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe_jax.config import MLA_IMPLS
from hybridmoe_jax.ops.attention import causal_attention
from hybridmoe_jax.ops.blockwise_attention import blockwise_attention, check_inputs
from hybridmoe_jax.ops.platform import GPU_PLATFORMS, on_row_shards, target_platform

XLA_CORES = ("dense", "blockwise")
KERNELS = ("cudnn", "triton", "splash")
# Where each kernel runs (interpret mode aside): cuDNN is NVIDIA's, Triton any JAX GPU.
KERNEL_BACKENDS = {"cudnn": ("gpu", "cuda"), "triton": GPU_PLATFORMS, "splash": ("tpu",)}
# "auto" tries these in order; the first whose constraints hold wins, else blockwise.
AUTO_ORDER = {"tpu": ("splash",), "gpu": ("cudnn", "triton"), "cuda": ("cudnn", "triton"),
              "rocm": ("triton",)}
TRITON_MAX_HEAD_DIM = 256   # the kernel holds a [tile, next_pow2(D)] block per program
SPLASH_TILE = 128           # splash tiles are multiples of the TPU's 128 lanes
CUDNN_NO_SEGMENTS = ("cudnn cannot take packed segment ids: jax.nn.dot_product_attention has "
                     "no segment argument, and a dense [B, 1, T, T] mask costs O(T^2) memory")


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def cudnn_head_dim(head_dim: int, v_head_dim: int) -> int:
  """The one head dim the cuDNN call sees: max(D, Dv) rounded up to a multiple of 8."""
  return _round_up(max(head_dim, v_head_dim), 8)


def cudnn_max_head_dim(compute_capability: str | None) -> int:
  """cuDNN flash attention's head-dim limit: 256 from Hopper (sm 9.0) on, else 128
  (unknown capability: the lower one)."""
  if compute_capability is None:
    return 128
  major = int(compute_capability.split(".")[0])
  return 256 if major >= 9 else 128


def unsupported(kernel: str, *, head_dim: int, v_head_dim: int, dtype: str,
                has_segments: bool, compute_capability: str | None = None) -> str | None:
  """Why `kernel` cannot take this input (a sentence), or None when it can.

  Args:
    kernel: one of KERNELS.
    head_dim, v_head_dim: D (queries / keys) and Dv (values).
    dtype: the q / k / v dtype name.
    has_segments: packed segment ids are given.
    compute_capability: the GPU's "major.minor" (cuDNN's head-dim limit), None if unknown.
  """
  dtype = jnp.dtype(dtype).name
  if kernel == "cudnn":
    if dtype not in ("bfloat16", "float16"):
      return f"cudnn needs float16/bfloat16, got {dtype}"
    if has_segments:
      return CUDNN_NO_SEGMENTS
    width, limit = cudnn_head_dim(head_dim, v_head_dim), cudnn_max_head_dim(compute_capability)
    if width > limit:
      return (f"cudnn head dim {width} (max(D={head_dim}, Dv={v_head_dim}) rounded up to 8) "
              f"exceeds {limit} on compute capability {compute_capability or 'unknown'}")
    return None
  if kernel == "triton":
    if dtype not in ("float32", "bfloat16", "float16"):
      return f"triton needs float32/bfloat16/float16, got {dtype}"
    width = _next_pow2(max(head_dim, v_head_dim))
    if width > TRITON_MAX_HEAD_DIM:
      return (f"triton head dim {width} (max(D={head_dim}, Dv={v_head_dim}) to a power of "
              f"two) exceeds {TRITON_MAX_HEAD_DIM}")
    return None
  if kernel == "splash":
    if dtype not in ("float32", "bfloat16"):
      return f"splash needs float32/bfloat16, got {dtype}"
    return None
  raise ValueError(f"kernel {kernel!r}: expected one of {KERNELS}")


def _xla_rule(seq_len: int, block: int) -> tuple[str, str]:
  """The XLA cost rule: dense while T <= 4 * block (its [T, T] scores are at most 16
  blocks, and one fused matmul beats a loop of small ones), blockwise beyond (memory
  O(T * block) instead of O(T^2))."""
  if seq_len <= 4 * block:
    return "dense", f"T={seq_len} <= 4 x mla_block={block}"
  return "blockwise", f"T={seq_len} > 4 x mla_block={block}"


def resolve_impl(impl: str, *, backend: str, seq_len: int, block: int, head_dim: int,
                 v_head_dim: int, dtype: str, has_segments: bool,
                 compute_capability: str | None = None, interpret: bool = False
                 ) -> tuple[str, str]:
  """Which core MLA training attention runs, and why: a pure function of its arguments.

  Args:
    impl: `compute.mla_impl`, one of MLA_IMPLS.
    backend: a jax platform name ("cpu", "gpu", "tpu", ...): `current_backend()`, the
      platform the step is compiled for.
    seq_len, block: T and `compute.mla_block` (the XLA cost rule, the kernels' tiles).
    head_dim, v_head_dim, dtype, has_segments, compute_capability: see `unsupported`.
    interpret: the Pallas kernels (triton, splash) run in interpret mode, on any backend
      (slow: tests only).
  Returns:
    (name, why): name in XLA_CORES + KERNELS. "auto" on TPU: splash; on GPU: cudnn when
    its constraints hold, else triton; either failing: blockwise, the reasons in `why`
    (a fallback); elsewhere the XLA cost rule. An explicit kernel that cannot take the
    input falls back to blockwise the same way.
  Raises:
    ValueError: impl unknown, or an explicit kernel that does not run on `backend`.
  """
  if impl not in MLA_IMPLS:
    raise ValueError(f"compute.mla_impl={impl!r}: expected one of {MLA_IMPLS}")
  if impl in XLA_CORES:
    return impl, f"compute.mla_impl={impl!r}"
  facts = dict(head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype,
               has_segments=has_segments, compute_capability=compute_capability)
  if impl == "auto":
    order = AUTO_ORDER.get(backend)
    if order is None:
      name, why = _xla_rule(seq_len, block)
      return name, f"compute.mla_impl='auto' on {backend}: {why}"
    reasons = []
    for kernel in order:
      why_not = unsupported(kernel, **facts)
      if why_not is None:
        tried = f" ({'; '.join(reasons)})" if reasons else ""
        return kernel, f"compute.mla_impl='auto' on {backend}: {kernel}{tried}"
      reasons.append(why_not)
    return "blockwise", (f"compute.mla_impl='auto' on {backend}: falls back to blockwise "
                         f"({'; '.join(reasons)})")
  where = KERNEL_BACKENDS[impl]
  if backend not in where and not (interpret and impl != "cudnn"):
    raise ValueError(f"compute.mla_impl={impl!r} runs on backend {' / '.join(where)} only, "
                     f"this backend is {backend!r}: use 'auto', 'dense' or 'blockwise'")
  why_not = unsupported(impl, **facts)
  if why_not is not None:
    return "blockwise", f"compute.mla_impl={impl!r} falls back to blockwise ({why_not})"
  return impl, f"compute.mla_impl={impl!r}" + (" (interpret mode)" if interpret else "")


def memory_core(impl: str, seq_len: int, block: int) -> str:
  """The XLA core ("dense" | "blockwise") whose memory stands for `impl` in a memory plan
  made on any machine: the kernels keep what blockwise keeps (the output and a log-sum-exp
  per query; tiles in on-chip memory), and "auto" follows the XLA cost rule (at short T
  dense: an upper bound for the kernels)."""
  if impl not in MLA_IMPLS:
    raise ValueError(f"compute.mla_impl={impl!r}: expected one of {MLA_IMPLS}")
  if impl in KERNELS:
    return "blockwise"
  return _xla_rule(seq_len, block)[0] if impl == "auto" else impl


def current_backend() -> tuple[str, str | None]:
  """(the target platform (`ops.platform.target_platform`: the active mesh's devices, else
  the host's backend), "rocm" for an AMD GPU; the first device's CUDA compute capability or
  None). A target other than the host's backend (an ahead-of-time compile for a TPU
  topology) has no local device to ask: (platform, None)."""
  backend, _ = target_platform()
  if backend not in GPU_PLATFORMS or backend != jax.default_backend():
    return backend, None
  device = jax.devices()[0]
  if "rocm" in str(getattr(device.client, "platform_version", "")).lower():
    return "rocm", None
  return backend, getattr(device, "compute_capability", None)


# ------------------------------------------------------------------------------ wrappers
def _check_self(q, k, v, segment_ids) -> None:
  check_inputs(q, k, v, segment_ids, segment_ids, 0)
  if q.shape[1] != k.shape[1]:
    raise ValueError(f"self-attention needs Tq == Tk: q {q.shape}, k {k.shape}")


def _pad_axis(x: jax.Array, axis: int, n: int, value=0) -> jax.Array:
  """Pad `axis` of x at the end up to n."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    segment_ids: jax.Array | None = None, scale: float | None = None,
                    implementation: str = "cudnn") -> jax.Array:
  """Causal attention through `jax.nn.dot_product_attention` (cuDNN flash attention).

  Args:
    q [B, T, H, D], k [B, T, Hk, D], v [B, T, Hk, Dv]: as in the module docstring.
    segment_ids: must be None (see the module docstring).
    scale: logit scale, default D**-0.5.
    implementation: "cudnn"; "xla" runs the same call through XLA (checks the argument
      mapping on machines without cuDNN).
  Returns:
    [B, T, H, Dv] in v's dtype.
  """
  _check_self(q, k, v, segment_ids)
  if segment_ids is not None:
    raise NotImplementedError(CUDNN_NO_SEGMENTS)
  d, dv = q.shape[-1], v.shape[-1]
  width = cudnn_head_dim(d, dv)
  q, k, v = (_pad_axis(x, 3, width) for x in (q, k, v))
  o = jax.nn.dot_product_attention(q, k, v, scale=d ** -0.5 if scale is None else scale,
                                   is_causal=True, implementation=implementation)
  return o[..., :dv].astype(v.dtype)


def _triton_tile(block: int, t: int) -> int:
  """A power of two in [16, block] (Triton tiles), no larger than T needs."""
  tile = 1 << (max(block, 16).bit_length() - 1)
  return min(tile, _next_pow2(max(t, 16)))


def triton_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     segment_ids: jax.Array | None = None, scale: float | None = None,
                     block: int = 128, block_bwd: int = 32,
                     interpret: bool = False) -> jax.Array:
  """Causal attention by Pallas' Triton flash-attention kernel (forward and backward).

  Args:
    q [B, T, H, D], k [B, T, Hk, D], v [B, T, Hk, Dv], segment_ids [B, T] or None.
    scale: logit scale, default D**-0.5.
    block, block_bwd: forward / backward tile tokens, rounded down to powers of two >= 16
      and capped at what T needs; T is padded to a multiple of both.
    interpret: run the kernel in Pallas' interpreter (any backend; tests).
  Returns:
    [B, T, H, Dv] in v's dtype; differentiable in q, k, v (the kernel's backward).
  """
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # lazy

  _check_self(q, k, v, segment_ids)
  b, t, h, d = q.shape
  dv = v.shape[-1]
  fwd, bwd = _triton_tile(block, t), _triton_tile(block_bwd, t)
  tp = _round_up(t, max(fwd, bwd))
  width = max(d, dv)
  groups = h // k.shape[2]
  q = _pad_axis(_pad_axis(q, 3, width), 1, tp)
  k, v = (_pad_axis(_pad_axis(jnp.repeat(x, groups, axis=2), 3, width), 1, tp)
          for x in (k, v))
  seg = None if segment_ids is None else _pad_axis(segment_ids.astype(jnp.int32), 1, tp, -1)
  tiles = gpu_attention.BlockSizes(block_q=fwd, block_k=fwd, block_q_dkv=bwd,
                                   block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
  o = gpu_attention.mha(q, k, v, seg, sm_scale=d ** -0.5 if scale is None else scale,
                        causal=True, block_sizes=tiles, interpret=interpret)
  return o[:, :t, :, :dv].astype(v.dtype)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     segment_ids: jax.Array | None = None, scale: float | None = None,
                     block: int = 128, interpret: bool = False) -> jax.Array:
  """Causal attention by TPU splash attention (forward and backward kernels).

  Args:
    q [B, T, H, D], k [B, T, Hk, D], v [B, T, Hk, Dv], segment_ids [B, T] or None.
    scale: logit scale, default D**-0.5 (applied to q: splash takes no scale).
    block: tile tokens, rounded up to a multiple of 128 and capped at what T needs; T is
      padded to a multiple of it.
    interpret: run the kernel in Pallas' interpreter (any backend; tests).
  Returns:
    [B, T, H, Dv] in v's dtype; differentiable in q, k, v.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # lazy
      splash_attention_kernel as splash, splash_attention_mask as masks)

  _check_self(q, k, v, segment_ids)
  b, t, h, d = q.shape
  hk = k.shape[2]
  tile = min(_round_up(max(block, 1), SPLASH_TILE), _round_up(t, SPLASH_TILE))
  tp = _round_up(t, tile)
  q = (q * (d ** -0.5 if scale is None else scale)).astype(q.dtype)
  q, k, v = (jnp.moveaxis(_pad_axis(x, 1, tp), 2, 1) for x in (q, k, v))  # [B, heads, T, .]
  mask = masks.MultiHeadMask([masks.CausalMask((tp, tp))] * h)
  tiles = splash.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile,
                            block_q_dkv=tile, block_kv_dkv=tile, block_kv_dkv_compute=tile,
                            block_q_dq=tile, block_kv_dq=tile)
  make = splash.make_splash_mqa if hk == 1 else splash.make_splash_mha
  kernel = make(mask, block_sizes=tiles, head_shards=1, q_seq_shards=1, interpret=interpret)
  if hk == 1:  # MQA: one [T, D] key / value head shared by all query heads
    k, v = k[:, 0], v[:, 0]
  if segment_ids is None:
    o = jax.vmap(kernel)(q, k, v)
  else:
    seg = _pad_axis(segment_ids.astype(jnp.int32), 1, tp, -1)
    o = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(
        q, k, v, seg)
  return jnp.moveaxis(o, 1, 2)[:, :t].astype(v.dtype)


def attend(name: str, q: jax.Array, k: jax.Array, v: jax.Array, *,
           segment_ids: jax.Array | None, scale: float, block: int,
           interpret: bool = False) -> jax.Array:
  """Runs the core `name` (from `resolve_impl`): shapes as in the module docstring.

  block: `compute.mla_block` (blockwise blocks, kernel tiles); interpret: the Pallas
  kernels in interpret mode."""
  if name == "dense":
    if k.shape[2] != q.shape[2]:
      raise ValueError(f"dense attention needs H == Hk: q {q.shape}, k {k.shape}")
    return causal_attention(q, k, v, segment_ids=segment_ids, scale=scale)
  if name == "blockwise":  # O(T x block) memory; its custom_vjp recomputes the blocks
    return blockwise_attention(q, k, v, segment_ids=segment_ids, scale=scale,
                               block_q=block, block_kv=block)
  if name == "cudnn":
    return cudnn_attention(q, k, v, segment_ids=segment_ids, scale=scale)
  if name in ("triton", "splash"):  # kernels XLA cannot partition: per device's rows
    kernel = triton_attention if name == "triton" else splash_attention
    return on_row_shards(lambda q, k, v, seg: kernel(q, k, v, segment_ids=seg, scale=scale,
                                                     block=block, interpret=interpret),
                         q, k, v, segment_ids)
  raise ValueError(f"attention core {name!r}: expected one of {XLA_CORES + KERNELS}")
