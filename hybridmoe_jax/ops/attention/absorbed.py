"""MLA's absorbed form (DESIGN s2): one shared KV head [c ; k_r] of width d_c + Dr, query
[W_uk_h q_nope_h ; q_rope_h] (`absorb`), output W_uv_h^T sum_j softmax(s)_j c_j (`unabsorb`),
attended blockwise with an online softmax (`latent_attention_partial`): the cached decode's
core, and the context runner's per-shard pass.

B batch, T tokens, H heads, d_c latent, Dn/Dr/Dv the nope/rope-slot/value head dims, N cache
capacity; up projections W_uk [d_c, H, Dn], W_uv [d_c, H, Dv].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import NEG_INF

_F32 = jnp.float32


def absorb(q: jax.Array, w_uk: jax.Array) -> jax.Array:
  """q [B, T, H, Dn + Dr], W_uk [d_c, H, Dn] -> absorbed q [B, T, H, d_c + Dr] in q's dtype."""
  dn = w_uk.shape[-1]
  q_c = jnp.einsum("bthn,chn->bthc", q[..., :dn], w_uk, preferred_element_type=_F32)
  return jnp.concatenate([q_c.astype(q.dtype), q[..., dn:]], axis=-1)


def unabsorb(o_c: jax.Array, w_uv: jax.Array, dtype) -> jax.Array:
  """o_c [B, T, H, d_c], W_uv [d_c, H, Dv] -> [B, T, H, Dv] float32 (matmul in `dtype`)."""
  return jnp.einsum("bthc,chv->bthv", o_c.astype(dtype), w_uv, preferred_element_type=_F32)


def write_cache(buf: jax.Array, new: jax.Array, start: jax.Array, n_valid: jax.Array) -> jax.Array:
  """buf[b, start[b] + i] = new[b, i] for i < n_valid[b]; padding (and overflow) dropped."""
  b, n = buf.shape[:2]
  i = jnp.arange(new.shape[1])[None, :]
  idx = jnp.where(i < n_valid[:, None], start[:, None] + i, n)    # out of range -> dropped
  return buf.at[jnp.arange(b)[:, None], idx].set(new.astype(buf.dtype), mode="drop")


def latent_attention_partial(q: jax.Array, c: jax.Array, k_r: jax.Array, q_pos: jax.Array,
                             total: jax.Array, scale: float, kv_block: int
                             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Causal attention of T queries over one shared latent KV head, blockwise (flash style),
  left unnormalised so that attention over pieces of a cache can be merged exactly
  (`parallel.context_decode` merges the pieces held by different devices).

  Args:
    q: [B, T, H, d_c + Dr] absorbed queries (`absorb`).
    c: [B, N, d_c] cached latents (keys and values); k_r: [B, N, Dr] cached rope keys.
    q_pos: [B, T] int32 positions of the queries in their row (key j visible iff j <= q_pos).
    total: [B] int32 filled positions per row; only ceil(total / kv_block) blocks of a row
      are read, so the cost grows with the context, not with the capacity N (queries past
      `total`, i.e. padding, see no keys beyond it).
    scale: logit scale.
    kv_block: keys per block.
  Returns:
    (m [B, T, H] running max of the logits (-1e30 where no key is visible), l [B, T, H] sum
    of exp(s - m), acc [B, T, H, d_c] sum of exp(s - m) c), all float32.
  """
  b, t, h, _ = q.shape
  n, d_c = c.shape[1:]
  blk = min(kv_block, n)
  q = q.reshape(b, t * h, -1)   # the heads share the keys

  def row(q, c, k_r, q_pos, total):
    """One row: q [T*H, D], c [N, d_c], k_r [N, Dr], q_pos [T], total []. Vmapped, so each
    row's blocks take the masked or the unmasked path by its own positions alone (a row's
    bits do not depend on which other rows share the batch)."""
    n_blocks = (total + blk - 1) // blk
    # Blocks that every query sees whole need no mask: on CPU the masks cost as much as the
    # block's matmuls (2.4x slower at 128K), and at long context nearly every block is such.
    n_full = jnp.clip((jnp.min(q_pos) + 1) // blk, 0, jnp.minimum(n_blocks, n // blk))

    def scores(start):
      kb = jnp.concatenate([jax.lax.dynamic_slice_in_dim(c, start, blk, axis=0),
                            jax.lax.dynamic_slice_in_dim(k_r, start, blk, axis=0)], axis=-1)
      return jnp.einsum("qd,nd->qn", q, kb, preferred_element_type=_F32) * scale, kb[:, :d_c]

    def update(carry, s, cb, seen):
      m, l, acc = carry
      if seen is not None:
        s = jnp.where(seen, s, NEG_INF)
      m_new = jnp.maximum(m, s.max(-1))
      e = jnp.exp(s - m_new[:, None])
      if seen is not None:
        e = jnp.where(seen, e, 0.0)
      corr = jnp.exp(m - m_new)
      acc = acc * corr[:, None] + jnp.einsum("qn,nc->qc", e.astype(cb.dtype), cb,
                                             preferred_element_type=_F32)
      return m_new, l * corr + e.sum(-1), acc

    def full_block(j, carry):
      s, cb = scores(j * blk)
      return update(carry, s, cb, None)

    def edge_block(j, carry):
      # The last block may overhang N: slide it back and mask what earlier blocks covered.
      start = jnp.minimum(j * blk, n - blk)
      s, cb = scores(start)
      k_pos = (start + jnp.arange(blk))[None, :]
      seen = (k_pos >= j * blk) & (k_pos <= q_pos[:, None])                  # [T, blk]
      return update(carry, s, cb, jnp.repeat(seen, h, axis=0))               # [T*H, blk]

    init = (jnp.full((t * h,), NEG_INF, _F32), jnp.zeros((t * h,), _F32),
            jnp.zeros((t * h, d_c), _F32))
    carry = jax.lax.fori_loop(0, n_full, full_block, init)
    return jax.lax.fori_loop(n_full, n_blocks, edge_block, carry)

  m, l, acc = jax.vmap(row)(q, c, k_r, q_pos, total)
  return m.reshape(b, t, h), l.reshape(b, t, h), acc.reshape(b, t, h, d_c)
