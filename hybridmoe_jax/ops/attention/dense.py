"""Causal softmax attention with packed-segment masking (the MLA core).

Conventions: B batch, T tokens, H heads, D head dims; segment ids [B, T] int32 (0 = padding).
"""

import jax
import jax.numpy as jnp


def segment_causal_mask(segment_ids: jax.Array | None, q_len: int, kv_len: int,
                        q_offset: int = 0) -> jax.Array:
  """[B or 1, q_len, kv_len] bool: key j is visible to query i (j <= i, same segment)."""
  qi = jnp.arange(q_len)[:, None] + q_offset
  kj = jnp.arange(kv_len)[None, :]
  mask = (kj <= qi)[None]
  if segment_ids is not None:
    q_seg = segment_ids[:, q_offset:q_offset + q_len]
    mask = mask & (q_seg[:, :, None] == segment_ids[:, None, :kv_len])
  return mask


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     segment_ids: jax.Array | None = None,
                     scale: float | None = None) -> jax.Array:
  """softmax(q k^T * scale + causal/segment mask) v, fp32 softmax.

  Args:
    q: [B, T, H, D] queries.
    k: [B, T, H, D] keys.
    v: [B, T, H, Dv] values.
    segment_ids: [B, T] int32; tokens attend only within their own segment.
    scale: logit scale, default D**-0.5.
  Returns:
    [B, T, H, Dv] in v's dtype.
  """
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [B, T, H, D]; got {q.shape}, {k.shape}, {v.shape}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"q and k head dims differ: q {q.shape}, k {k.shape}")
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  t = q.shape[1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  mask = segment_causal_mask(segment_ids, t, k.shape[1])[:, None]
  # Mask before the softmax with a finite value so fully-masked rows stay NaN-free.
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v,
                    preferred_element_type=jnp.float32).astype(v.dtype)
