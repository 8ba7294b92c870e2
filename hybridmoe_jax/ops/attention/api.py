"""MLA attention (DESIGN s2): `latent_attention` (training; table `choose`: "context" under a
plan, else `resolve_impl`) and `cached_latent_attention` (decode; `choose_cached`).

Training cores compute `reference.attention_reference` for self-attention: q [B, T, H, D],
k [B, T, Hk, D], v [B, T, Hk, Dv] (H a multiple of Hk), segment_ids [B, T] int32 or None
-> [B, T, H, Dv]. "dense", "blockwise" (XLA), "cudnn", "triton", "splash" (kernels), one
file each; `resolve_impl` is a pure function of (impl, backend, shapes, dtype,
has_segments), so every branch is checked on any machine; `attend` runs the pick.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe_jax.config import MLA_IMPLS

from ..plan import ExecutionPlan, current_plan, run_local
from ..platform import GPU_PLATFORMS, on_row_shards, target_platform
from .absorbed import absorb, latent_attention_partial, unabsorb, write_cache
from .blockwise import blockwise_attention
from .cudnn import CUDNN_NO_SEGMENTS, cudnn_attention, cudnn_head_dim, cudnn_max_head_dim
from .dense import causal_attention
from .reference import next_pow2
from .splash import splash_attention
from .triton import triton_attention

XLA_CORES = ("dense", "blockwise")
KERNELS = ("cudnn", "triton", "splash")
# Where each kernel runs (interpret mode aside): cuDNN is NVIDIA's, Triton any JAX GPU.
KERNEL_BACKENDS = {"cudnn": ("gpu", "cuda"), "triton": GPU_PLATFORMS, "splash": ("tpu",)}
# The q / k / v dtypes each kernel takes.
KERNEL_DTYPES = {"cudnn": ("float16", "bfloat16"), "triton": ("float32", "bfloat16", "float16"),
                 "splash": ("float32", "bfloat16")}
# "auto" tries these in order; the first whose constraints hold wins, else blockwise.
AUTO_ORDER = {"tpu": ("splash",), "gpu": ("cudnn", "triton"), "cuda": ("cudnn", "triton"),
              "rocm": ("triton",)}
TRITON_MAX_HEAD_DIM = 256   # the kernel holds a [tile, next_pow2(D)] block per program


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
  if kernel not in KERNELS:
    raise ValueError(f"kernel {kernel!r}: expected one of {KERNELS}")
  dtype = jnp.dtype(dtype).name
  if dtype not in KERNEL_DTYPES[kernel]:
    return f"{kernel} needs {'/'.join(KERNEL_DTYPES[kernel])}, got {dtype}"
  if kernel == "cudnn":
    if has_segments:
      return CUDNN_NO_SEGMENTS
    width, limit = cudnn_head_dim(head_dim, v_head_dim), cudnn_max_head_dim(compute_capability)
    if width > limit:
      return (f"cudnn head dim {width} (max(D={head_dim}, Dv={v_head_dim}) rounded up to 8) "
              f"exceeds {limit} on compute capability {compute_capability or 'unknown'}")
  if kernel == "triton":
    width = next_pow2(max(head_dim, v_head_dim))
    if width > TRITON_MAX_HEAD_DIM:
      return (f"triton head dim {width} (max(D={head_dim}, Dv={v_head_dim}) to a power of "
              f"two) exceeds {TRITON_MAX_HEAD_DIM}")
  return None


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


def choose(impl: str, *, plan: ExecutionPlan | None = None, **facts) -> tuple[str, str]:
  """The training forward's dispatch table: (name, reason). "context" under a plan with a
  context runner, else `attention_resolve_impl(impl, **facts)`."""
  plan = current_plan() if plan is None else plan
  if plan.context is not None:
    return "context", f"absorbed over the sequence shards of {type(plan.context).__name__}"
  return resolve_impl(impl, **facts)


def choose_cached(plan: ExecutionPlan | None = None) -> tuple[str, str]:
  """The cached forward's dispatch table: (name, reason)."""
  plan = current_plan() if plan is None else plan
  if plan.shards_cache:
    return "context_cache", "the cache is sharded over the context axis (plan)"
  return "absorbed", "blockwise online softmax over the filled cache"


def latent_attention(q: jax.Array, c: jax.Array, k_r: jax.Array, w_uk: jax.Array,
                     w_uv: jax.Array, *, segment_ids: jax.Array | None, scale: float,
                     impl: str, block: int, interpret: bool = False) -> jax.Array:
  """Causal attention of whole (packed) sequences over their latents (training): q [B, T,
  H, Dn + Dr], c [B, T, d_c], k_r [B, T, Dr], w_uk / w_uv in the compute dtype, segment_ids
  [B, T] int32 or None -> [B, T, H, Dv] (float32 or the core's dtype). impl, block,
  interpret: `compute.mla_impl`, `compute.mla_block`, the Pallas interpreter (tests)."""
  b, t, h, _ = q.shape
  backend, capability = current_backend()
  name, _ = choose(impl, backend=backend, seq_len=t, block=block, head_dim=q.shape[-1],
                   v_head_dim=w_uv.shape[-1], dtype=jnp.dtype(q.dtype).name,
                   has_segments=segment_ids is not None, compute_capability=capability,
                   interpret=interpret)
  if name == "context":
    o_c = run_local(current_plan().context.latent_attention, absorb(q, w_uk), c, k_r,
                    segment_ids=segment_ids, scale=scale)
    return unabsorb(o_c, w_uv, q.dtype)
  k = jnp.einsum("btc,chn->bthn", c, w_uk)
  k = jnp.concatenate([k, jnp.broadcast_to(k_r[:, :, None, :], (b, t, h, k_r.shape[-1]))
                       .astype(k.dtype)], axis=-1)
  v = jnp.einsum("btc,chv->bthv", c, w_uv)
  return attend(name, q, k, v, segment_ids=segment_ids, scale=scale, block=block,
                         interpret=interpret)


def cached_latent_attention(q: jax.Array, c: jax.Array, k_r: jax.Array, cache,
                            length: jax.Array, n_valid: jax.Array, w_uk: jax.Array,
                            w_uv: jax.Array, *, scale: float, kv_block: int):
  """Writes a chunk's latents (c [B, T, d_c], k_r [B, T, Dr]) into the cache (fields c
  [B, N, d_c], k_r [B, N, Dr]: `layers.mla.MLACache` or the plan's sharded one) and attends
  with q [B, T, H, Dn + Dr]: row b's token i sits at position length[b] + i (length, n_valid
  [B] int32: tokens cached before, real tokens of the chunk, a prefix of each row).
  Returns (o [B, T, H, Dv] float32, the updated cache)."""
  q_abs = absorb(q, w_uk)
  if choose_cached()[0] == "context_cache":
    o_c, cache = run_local(current_plan().context.cached_latent_attention, q_abs, c, k_r,
                           cache, n_valid, scale=scale, kv_block=kv_block)
    return unabsorb(o_c, w_uv, q.dtype), cache
  cache = cache._replace(c=write_cache(cache.c, c, length, n_valid),
                         k_r=write_cache(cache.k_r, k_r, length, n_valid))
  q_pos = length[:, None] + jnp.arange(q.shape[1])[None, :]
  _, l, acc = latent_attention_partial(q_abs, cache.c, cache.k_r, q_pos, length + n_valid,
                                       scale, kv_block)
  return unabsorb(acc / jnp.maximum(l, 1e-30)[..., None], w_uv, q.dtype), cache
