"""The kernels' XLA part: `chunk_prep`, the chunk-parallel quantities of the chunked form
(W, U, q e^G, k e^(G_C - G), A_qk, e^G_C) with the kernels' anchoring and refined 16 x 16
inverses.

Conventions: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
state [B, HV, K, V] float32. Chunk layout [B*HV, N, C, F] float32 (N chunks of C tokens).
The chunk-parallel quantities: the split forward feeds them to the Pallas recurrence, and the
backward takes jax.vjp of it for the intra-chunk gradients (README.md). The fused forward
kernel computes the same math in-kernel, solving for Vn = U - W S directly.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .chunk_xla import SUB, causal_mask, intra_chunk_scores, mm, sub_blocks, unit_lower_solve

_f32 = jnp.float32


class ChunkPrep(NamedTuple):
  """Per-chunk quantities, float32, layout [B*HV, N, C, F]."""

  w: jax.Array  # [.., C, K]  (I + L)^-1 beta k e^G
  u: jax.Array  # [.., C, V]  (I + L)^-1 beta v
  q_in: jax.Array  # [.., C, K]  scale q e^G
  k_out: jax.Array  # [.., C, K]  k e^(G_C - G)
  a_qk: jax.Array  # [.., C, C]  scale * lower(A_qk), zero above the diagonal
  decay: jax.Array  # [.., 1, K]  e^G_C


def to_chunks(x: jax.Array, c: int) -> jax.Array:
  """[B, T, HV, ...] -> [B*HV, N, C, ...] float32 (chunks of c tokens), zero-padded along T."""
  n = -(-x.shape[1] // c)
  x = jnp.pad(x.astype(_f32), [(0, 0), (0, n * c - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  x = jnp.moveaxis(x.reshape(x.shape[0], n, c, *x.shape[2:]), 3, 1)
  return x.reshape(-1, *x.shape[2:])


def chunk_cumsum(g: jax.Array) -> jax.Array:
  """Inclusive cumsum G of chunks g [..., C, K], from 16-block cumsums (segments are masked
  by the callers, not here)."""
  nb = g.shape[-2] // SUB
  Gl = mm(causal_mask(SUB).astype(_f32), sub_blocks(g))
  before = jnp.tril(jnp.ones((nb, nb), _f32), -1)
  return (mm(before, Gl[..., -1, :])[..., None, :] + Gl).reshape(g.shape)


def chunk_prep(q, k, v, g, beta, seg=None, *, scale: float, lower_bound: float,
               chunk_size: int) -> ChunkPrep:
  """The chunk-parallel part of KDA (DESIGN s1.1) with the bounded-gate diagonal blocks.

  Packed sequences (seg given) keep the plain, unrestarted chunk cumsum G: every factor the
  chunked form needs spans tokens of one segment only (a pair inside a segment; a row and
  the chunk start for the incoming state; a row and the chunk end for the outgoing one), and
  for those the plain differences equal the restarted ones. Pairs across segments, rows
  after a segment start (incoming state) and rows before the chunk's last start (outgoing
  state) are masked to zero; the state recurrence is then unchanged, with decay 0 for a
  chunk that holds a start (the state resets).

  Args: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
    seg: optional [B, Tp] float32 chunk-local segment index (segments.py).
  Returns: ChunkPrep in layout [B*HV, N, C, F]; zero padding makes extra tokens no-ops.
  """
  rep, HV = v.shape[2] // q.shape[2], v.shape[2]
  c = chunk_size
  qc = to_chunks(jnp.repeat(q, rep, axis=2), c)
  kc = to_chunks(jnp.repeat(k, rep, axis=2), c)
  vc, gc = to_chunks(v, c), to_chunks(g, c)
  bc = to_chunks(beta, c)[..., None]
  G = chunk_cumsum(gc)
  sc = None if seg is None else jnp.repeat(seg.reshape(seg.shape[0], -1, c), HV, axis=0)
  a_qk, a_kk = intra_chunk_scores(qc, kc, gc, sc, lower_bound)
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  lower = jnp.where(strict, bc * a_kk, 0.0)
  # Every exponent below is <= 0 (sums of gates), so masking the product is NaN-free.
  decay_in = jnp.exp(G)
  out_decay = jnp.exp(G[..., -1:, :] - G)
  decay = jnp.exp(G[..., -1:, :])
  if sc is not None:
    decay_in = jnp.where(sc[..., None] == 0, decay_in, 0.0)
    out_decay = jnp.where(sc[..., None] == sc[..., -1:, None], out_decay, 0.0)
    decay = jnp.where(sc[..., -1:, None] == 0, decay, 0.0)
  K = qc.shape[-1]
  # 16 x 16 inverses refined by two Newton steps (the kernels take one: NUMERICS.md).
  wu = unit_lower_solve(lower, jnp.concatenate([bc * kc * decay_in, bc * vc], axis=-1),
                        newton_steps=2)
  return ChunkPrep(
      w=wu[..., :K],
      u=wu[..., K:],
      q_in=scale * qc * decay_in,
      k_out=kc * out_decay,
      a_qk=scale * a_qk,
      decay=decay,
  )
