"""MLA attention's contract and exact reference: the input checks every core shares, their
shape helpers, and `attention_reference` (dense, the tests' reference of every core).

Conventions: B batch, Tq / Tk query / key tokens, H query heads, Hk key/value heads (H a
multiple of Hk), D / Dv head dims; key j is visible to query i iff j <= q_offset + i and
their segment ids are equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
# Finite "minus infinity" of the masked logits: exp(NEG_INF - m) == 0 without inf - inf, so
# fully masked rows and blocks stay NaN-free.
NEG_INF = -1e30


def check_inputs(q, k, v, q_seg, kv_seg, q_offset) -> None:
  """Raises ValueError for q, k, v, segment ids or q_offset that do not fit together."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [B, T, H, D]; got {q.shape}, {k.shape}, {v.shape}")
  b, tq, h, d = q.shape
  if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[-1] != d:
    raise ValueError(f"k [B, Tk, Hk, D] and v [B, Tk, Hk, Dv] must match q [B, Tq, H, D]: "
                     f"q {q.shape}, k {k.shape}, v {v.shape}")
  if h % k.shape[2]:
    raise ValueError(f"query heads {h} must be a multiple of key/value heads {k.shape[2]}")
  if (q_seg is None) != (kv_seg is None):
    raise ValueError("give both q_segment_ids and kv_segment_ids, or neither")
  if q_seg is not None and (q_seg.shape != (b, tq) or kv_seg.shape != (b, k.shape[1])):
    raise ValueError(f"segment ids must be [B, Tq] and [B, Tk]: got {q_seg.shape}, "
                     f"{kv_seg.shape} for Tq={tq}, Tk={k.shape[1]}")
  # The cores compare ids as int32 (blockwise, triton, splash cast them): float ids such as
  # 0.0 and 0.5 would merge there but stay apart in the dense core.
  for name, seg in (("q_segment_ids", q_seg), ("kv_segment_ids", kv_seg)):
    if seg is not None and not jnp.issubdtype(jnp.asarray(seg).dtype, jnp.integer):
      raise ValueError(f"segment ids must be an integer array, got {name} of dtype "
                       f"{jnp.asarray(seg).dtype} (shape {seg.shape})")
  if isinstance(q_offset, jax.core.Tracer):  # a shard's offset inside shard_map: unchecked
    return
  if not 0 <= q_offset or q_offset + tq > k.shape[1]:
    raise ValueError(f"q_offset={q_offset}: queries [q_offset, q_offset + Tq) = "
                     f"[{q_offset}, {q_offset + tq}) must lie within the {k.shape[1]} keys")


def check_self(q, k, v, segment_ids) -> None:
  check_inputs(q, k, v, segment_ids, segment_ids, 0)
  if q.shape[1] != k.shape[1]:
    raise ValueError(f"self-attention needs Tq == Tk: q {q.shape}, k {k.shape}")


def pad_axis(x: jax.Array, axis: int, n: int, value=0) -> jax.Array:
  """Pad `axis` of x at the end up to n."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        q_segment_ids: jax.Array | None = None,
                        kv_segment_ids: jax.Array | None = None, q_offset: int = 0,
                        scale: float | None = None) -> jax.Array:
  """The dense form of `blockwise_attention` (same arguments but the block sizes): the exact
  reference its tests compare with. Holds [B, H, Tq, Tk] scores."""
  check_inputs(q, k, v, q_segment_ids, kv_segment_ids, q_offset)
  b, tq, h, d = q.shape
  hk = k.shape[2]
  scale = d ** -0.5 if scale is None else scale
  qg = q.reshape(b, tq, hk, h // hk, d)
  s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=_F32) * scale
  qpos = q_offset + jnp.arange(tq)
  visible = jnp.arange(k.shape[1])[None, :] <= qpos[:, None]              # [Tq, Tk]
  visible = visible[None]
  if q_segment_ids is not None:
    visible = visible & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])
  visible = visible[:, None, None]                                       # [B,1,1,Tq,Tk]
  s = jnp.where(visible, s, NEG_INF)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(visible, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  o = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=_F32)
  return o.reshape(b, tq, h, v.shape[-1]).astype(v.dtype)
