"""Causal softmax attention with packed-segment masking (the MLA core).

Conventions: B batch, T tokens, H heads, D head dims; segment ids [B, T] int32 (0 = padding).
"""

import jax
import jax.numpy as jnp

from .reference import check_self


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
  Raises:
    ValueError: shapes that do not fit (`reference.check_self`), or k / v with fewer heads
      than q (grouped heads: use `blockwise_attention`).
  """
  check_self(q, k, v, segment_ids)
  if k.shape[2] != q.shape[2]:  # check_self admits grouped heads; this core does not
    raise ValueError(f"dense attention needs H == Hk (no grouped heads): q {q.shape}, "
                     f"k {k.shape}")
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  t = q.shape[1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
  mask = (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])[None]  # [B or 1, T, T]: j <= i
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  # Mask before the softmax with a finite value so fully-masked rows stay NaN-free.
  logits = jnp.where(mask[:, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v,
                    preferred_element_type=jnp.float32).astype(v.dtype)
