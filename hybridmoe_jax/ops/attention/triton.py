"""The triton core: Pallas' GPU flash attention (`jax.experimental.pallas.ops.gpu.attention.mha`).

Causal + segment ids, own backward. Needs equal head counts (k, v are repeated per group),
one head dim (zero-padded) and T a multiple of its tiles (padded at the end: causality
keeps every real query off the padded keys). The Pallas module is imported at use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import check_self, next_pow2, pad_axis, round_up


def _triton_tile(block: int, t: int) -> int:
  """A power of two in [16, block] (Triton tiles), no larger than T needs."""
  tile = 1 << (max(block, 16).bit_length() - 1)
  return min(tile, next_pow2(max(t, 16)))


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

  check_self(q, k, v, segment_ids)
  b, t, h, d = q.shape
  dv = v.shape[-1]
  fwd, bwd = _triton_tile(block, t), _triton_tile(block_bwd, t)
  tp = round_up(t, max(fwd, bwd))
  width = max(d, dv)
  groups = h // k.shape[2]
  q = pad_axis(pad_axis(q, 3, width), 1, tp)
  k, v = (pad_axis(pad_axis(jnp.repeat(x, groups, axis=2), 3, width), 1, tp)
          for x in (k, v))
  seg = None if segment_ids is None else pad_axis(segment_ids.astype(jnp.int32), 1, tp, -1)
  tiles = gpu_attention.BlockSizes(block_q=fwd, block_k=fwd, block_q_dkv=bwd,
                                   block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
  o = gpu_attention.mha(q, k, v, seg, sm_scale=d ** -0.5 if scale is None else scale,
                        causal=True, block_sizes=tiles, interpret=interpret)
  return o[:, :t, :, :dv].astype(v.dtype)
