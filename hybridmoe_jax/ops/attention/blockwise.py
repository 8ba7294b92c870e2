"""Causal softmax attention in blocks, O(T x block) memory forward and backward (pure XLA).

The MLA training core at long context: the dense form (`dense.causal_attention`)
holds a [B, H, T, T] score matrix (256 GiB at 8K tokens for the 1M preset's heads), this one
holds [B, H, block_q, block_kv] at a time. Forward: an online softmax over key blocks
(fp32 running max and sum), saving the output and the log-sum-exp per query. Backward
(custom_vjp): recomputes each block's probabilities from the saved log-sum-exp, FlashAttention-2
style, accumulating dk, dv per key block and dq in place.

Blocks that no query of a block may see are skipped, not masked: key blocks above the
diagonal are never visited (loop bounds), and a (query block, key block) pair whose segment-id
ranges do not overlap is passed over with `lax.cond` (packed documents: a query block never
reads the blocks of earlier documents). Both tests are exact (necessary conditions for any
visible pair), so skipping changes no result.

Conventions: B batch, Tq / Tk query / key tokens, H query heads, Hk key/value heads (H a
multiple of Hk: grouped heads; Hk = 1 is the absorbed MLA form with one shared latent head),
D / Dv head dims. Query i sits at position q_offset + i, key j at position j; key j is visible
to query i iff j <= q_offset + i and their segment ids are equal. A query that sees no key
(possible with separate q / kv segment ids) gets output 0 and gradient 0.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .reference import NEG_INF, check_inputs, pad_axis

_F32 = jnp.float32


class _Spec(NamedTuple):
  """Static shape facts of one call (hashable: a custom_vjp nondiff argument)."""

  scale: float
  block_q: int
  block_kv: int
  tq: int          # real (unpadded) lengths
  tk: int


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                        segment_ids: jax.Array | None = None,
                        q_segment_ids: jax.Array | None = None,
                        kv_segment_ids: jax.Array | None = None, q_offset: int = 0,
                        scale: float | None = None, block_q: int = 128,
                        block_kv: int = 128) -> jax.Array:
  """softmax(q k^T * scale + causal/segment mask) v without a [Tq, Tk] matrix.

  Args:
    q: [B, Tq, H, D] queries.
    k: [B, Tk, Hk, D] keys (H a multiple of Hk).
    v: [B, Tk, Hk, Dv] values.
    segment_ids: [B, T] int32 packed document ids for self-attention (Tq == Tk); or give
      q_segment_ids [B, Tq] and kv_segment_ids [B, Tk] separately (a query shard against
      gathered keys). Tokens attend within their own id only.
    q_offset: position of query 0 among the keys (queries are keys q_offset..q_offset+Tq-1);
      an int, or a traced int32 scalar (e.g. a context-parallel shard's start).
    scale: logit scale, default D**-0.5.
    block_q, block_kv: tokens per block (any T: the last block is padded and masked).
  Returns:
    [B, Tq, H, Dv] in v's dtype; differentiable in q, k, v (recomputing backward).
  """
  if segment_ids is not None:
    if q_segment_ids is not None or kv_segment_ids is not None:
      raise ValueError("give segment_ids, or q_segment_ids and kv_segment_ids, not both")
    q_segment_ids = kv_segment_ids = segment_ids
  check_inputs(q, k, v, q_segment_ids, kv_segment_ids, q_offset)
  if block_q < 1 or block_kv < 1:
    raise ValueError(f"block_q={block_q}, block_kv={block_kv}: must be >= 1")
  b, tq, _, d = q.shape
  tk = k.shape[1]
  if q_segment_ids is None:  # one segment: the range test never skips
    q_segment_ids = jnp.zeros((b, tq), jnp.int32)
    kv_segment_ids = jnp.zeros((b, tk), jnp.int32)
  spec = _Spec(float(d ** -0.5 if scale is None else scale), min(block_q, tq),
               min(block_kv, tk), tq, tk)
  return _attention(spec, q, k, v, q_segment_ids.astype(jnp.int32),
                    kv_segment_ids.astype(jnp.int32), jnp.asarray(q_offset, jnp.int32))


# ------------------------------------------------------------------------------ blocking
def _slice(x: jax.Array, i, size: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=1)


def _seg_ranges(seg: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """Per block of `size` tokens, the min and max segment id over the batch: [n], [n]."""
  blocks = seg.reshape(seg.shape[0], -1, size)
  return blocks.min(axis=(0, 2)), blocks.max(axis=(0, 2))


class _Blocked(NamedTuple):
  q: jax.Array          # [B, nq*bq, Hk, G, D]
  k: jax.Array          # [B, nk*bk, Hk, D]
  v: jax.Array          # [B, nk*bk, Hk, Dv]
  q_seg: jax.Array      # [B, nq*bq]
  kv_seg: jax.Array     # [B, nk*bk]
  q_rng: tuple          # per query block (min, max) segment id
  kv_rng: tuple
  q_offset: jax.Array   # int32 []
  nq: int
  nk: int


def _blocked(spec: _Spec, q, k, v, q_seg, kv_seg, q_offset) -> _Blocked:
  b, _, h, d = q.shape
  hk = k.shape[2]
  bq, bk = spec.block_q, spec.block_kv
  nq, nk = -(-spec.tq // bq), -(-spec.tk // bk)
  q = pad_axis(q, 1, nq * bq).reshape(b, nq * bq, hk, h // hk, d)
  # Padded keys get an id no query holds; padded queries one no key holds.
  q_seg = pad_axis(q_seg, 1, nq * bq, jnp.iinfo(jnp.int32).min)
  kv_seg = pad_axis(kv_seg, 1, nk * bk, jnp.iinfo(jnp.int32).max)
  return _Blocked(q, pad_axis(k, 1, nk * bk), pad_axis(v, 1, nk * bk), q_seg, kv_seg,
                  _seg_ranges(q_seg, bq), _seg_ranges(kv_seg, bk), q_offset, nq, nk)


def _visible(spec: _Spec, blk: _Blocked, i, j) -> jax.Array:
  """[B, 1, 1, bq, bk] bool: key block j is visible to query block i, per pair."""
  bq, bk = spec.block_q, spec.block_kv
  qpos = blk.q_offset + i * bq + jnp.arange(bq)
  kpos = j * bk + jnp.arange(bk)
  causal = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < spec.tk)
  same = _slice(blk.q_seg, i, bq)[:, :, None] == _slice(blk.kv_seg, j, bk)[:, None, :]
  return (causal[None] & same)[:, None, None]


def _overlap(blk: _Blocked, i, j) -> jax.Array:
  """False when no query of block i can share a segment with a key of block j."""
  (qlo, qhi), (klo, khi) = blk.q_rng, blk.kv_rng
  return (klo[j] <= qhi[i]) & (qlo[i] <= khi[j])


def _scores(spec: _Spec, qi, kj) -> jax.Array:
  """qi [B, bq, Hk, G, D], kj [B, bk, Hk, D] -> [B, Hk, G, bq, bk] fp32 logits."""
  return jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=_F32) * spec.scale


def _kv_blocks_for(spec: _Spec, blk: _Blocked, i):
  """One past the last key block that query block i can see (causality)."""
  last_q = blk.q_offset + (i + 1) * spec.block_q - 1
  return jnp.minimum(blk.nk, last_q // spec.block_kv + 1)


def _q_blocks_from(spec: _Spec, blk: _Blocked, j):
  """The first query block that can see key block j (causality)."""
  return jnp.clip((j * spec.block_kv - blk.q_offset) // spec.block_q, 0, blk.nq)


# ------------------------------------------------------------------------------ forward
def _forward(spec: _Spec, q, k, v, q_seg, kv_seg, q_offset):
  """-> out [B, Tq, H, Dv] (v's dtype), lse [B, Hk, G, nq*bq] fp32 (+inf: no visible key)."""
  blk = _blocked(spec, q, k, v, q_seg, kv_seg, q_offset)
  b, _, hk, g, _ = blk.q.shape
  dv = v.shape[-1]
  bq, bk = spec.block_q, spec.block_kv

  def q_block(i):
    qi = _slice(blk.q, i, bq)

    def kv_step(j, carry):
      def update(carry):
        m, l, acc = carry
        s = _scores(spec, qi, _slice(blk.k, j, bk))
        vis = _visible(spec, blk, i, j)
        s = jnp.where(vis, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        vj = _slice(blk.v, j, bk)
        acc = acc * corr[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vj.dtype), vj,
                                                 preferred_element_type=_F32)
        return m_new, l * corr + p.sum(-1), acc
      return jax.lax.cond(_overlap(blk, i, j), update, lambda c: c, carry)

    init = (jnp.full((b, hk, g, bq), NEG_INF, _F32), jnp.zeros((b, hk, g, bq), _F32),
            jnp.zeros((b, hk, g, bq, dv), _F32))
    m, l, acc = jax.lax.fori_loop(0, _kv_blocks_for(spec, blk, i), kv_step, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    return out, lse

  out, lse = jax.lax.map(q_block, jnp.arange(blk.nq))      # [nq, B, Hk, G, bq, (Dv)]
  out = jnp.moveaxis(out, 0, 3).reshape(b, hk, g, blk.nq * bq, dv)
  out = jnp.moveaxis(out, 3, 1).reshape(b, blk.nq * bq, hk * g, dv)[:, :spec.tq]
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, hk, g, blk.nq * bq)
  return out.astype(v.dtype), lse


# ------------------------------------------------------------------------------ backward
def _backward(spec: _Spec, res, d_out):
  q, k, v, q_seg, kv_seg, q_offset, out, lse = res
  blk = _blocked(spec, q, k, v, q_seg, kv_seg, q_offset)
  b, tqp, hk, g, d = blk.q.shape
  bq, bk = spec.block_q, spec.block_kv
  do = pad_axis(d_out, 1, tqp).reshape(b, tqp, hk, g, -1)
  # delta_i = sum_d dO_i * O_i: the softmax backward's row term, once per query.
  delta = jnp.einsum("bqkgd,bqkgd->bkgq", do.astype(_F32),
                     pad_axis(out, 1, tqp).reshape(do.shape).astype(_F32))

  def kv_block(dq, j):
    kj, vj = _slice(blk.k, j, bk), _slice(blk.v, j, bk)

    def q_step(i, carry):
      def update(carry):
        dq, dk, dv = carry
        qi, doi = _slice(blk.q, i, bq), _slice(do, i, bq)
        lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
        delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
        vis = _visible(spec, blk, i, j)
        p = jnp.where(vis, jnp.exp(_scores(spec, qi, kj) - lse_i[..., None]), 0.0)
        dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(doi.dtype), doi,
                             preferred_element_type=_F32)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=_F32)
        ds = p * (dp - delta_i[..., None]) * spec.scale
        dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qi.dtype), qi,
                             preferred_element_type=_F32)
        dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kj.dtype), kj,
                          preferred_element_type=_F32)
        dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i, bq) + dq_i, i * bq, axis=1)
        return dq, dk, dv
      return jax.lax.cond(_overlap(blk, i, j), update, lambda c: c, carry)

    init = (dq, jnp.zeros(kj.shape, _F32), jnp.zeros(vj.shape, _F32))
    dq, dk, dv = jax.lax.fori_loop(_q_blocks_from(spec, blk, j), blk.nq, q_step, init)
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(kv_block, jnp.zeros(blk.q.shape, _F32), jnp.arange(blk.nk))
  dk = jnp.moveaxis(dk, 0, 1).reshape(b, blk.nk * bk, hk, d)[:, :spec.tk]
  dv = jnp.moveaxis(dv, 0, 1).reshape(b, blk.nk * bk, hk, -1)[:, :spec.tk]
  dq = dq.reshape(b, tqp, hk * g, d)[:, :spec.tq]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec: _Spec, q, k, v, q_seg, kv_seg, q_offset):
  return _forward(spec, q, k, v, q_seg, kv_seg, q_offset)[0]


def _attention_fwd(spec: _Spec, q, k, v, q_seg, kv_seg, q_offset):
  out, lse = _forward(spec, q, k, v, q_seg, kv_seg, q_offset)
  return out, (q, k, v, q_seg, kv_seg, q_offset, out, lse)


_attention.defvjp(_attention_fwd, _backward)
