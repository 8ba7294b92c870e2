"""The chunked KDA form's per-chunk math in XLA (DESIGN s1.1-1.3): shared by the ops' chunked
path (hybridmoe_jax/ops/kda/chunked.py) and the kernels' XLA prep (prep.py).

Conventions: one block of n (<= 16) tokens, with any leading batch dims `...`.
diag_block_pairwise: a, b: [..., n, K] row/column features (q or k); G: [..., n, K] float32
cumulative log decay over the block (any constant offset per channel); result [..., n, n]
float32 with

    A[i, j] = sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c])   for i >= j, and 0 above the diagonal.

The decay is per channel, so it cannot leave the channel sum: the pairwise form builds the
[n, n, K] decay tensor and is safe for any gate. (The bounded gate's alternative, one matmul
of anchored factor pairs, is `decays` / `scores` below.)
invert_unit_lower: (I + L)^-1 of strictly lower 16 x 16 blocks, from matmuls only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST
SUB = 16  # block length: diagonal blocks are 16 x 16
_f32 = jnp.float32


def causal_mask(n: int) -> jax.Array:
  """[n, n] bool, True on and below the diagonal (i >= j)."""
  return jnp.tril(jnp.ones((n, n), bool))


def diag_block_pairwise(a: jax.Array, b: jax.Array, G: jax.Array) -> jax.Array:
  """Lower-triangular block via the [..., n, n, K] pairwise decay tensor; any gate <= 0.

  Args:
    a, b: [..., n, K] row and column features (leading dims broadcast together).
    G: [..., n, K] float32 cumulative log decay.

  Returns:
    A: [..., n, n] float32, zero above the diagonal.
  """
  keep = causal_mask(G.shape[-2])
  diff = G[..., :, None, :] - G[..., None, :, :]  # [..., n, n, K]
  # Mask the exponent, not the exp: above the diagonal diff > 0 and may overflow, and
  # where(mask, exp(diff), 0) would turn that inf into a NaN gradient.
  decay = jnp.exp(jnp.where(keep[..., None], diff, -jnp.inf))
  weighted = b[..., None, :, :].astype(jnp.float32) * decay  # [..., i, j, K]
  # A row-vector x matrix contraction per row i. Written this way (not as one fused
  # product-and-sum) XLA CPU stays fast when `a` carries an extra broadcast dim, as in
  # kda_chunked, where q and k rows share one decay tensor.
  return jnp.einsum("...ic,...ijc->...ij", a.astype(jnp.float32), weighted, precision=_HIGHEST)


def invert_unit_lower(L: jax.Array, newton_steps: int = 1) -> jax.Array:
  """(I + L)^-1 for strictly lower-triangular L: [..., n, n] float32, n <= 16.

  L is nilpotent (L^n = 0), so (I + L)^-1 = sum_p (-L)^p = (I - L)(I + L^2)(I + L^4)(I + L^8)
  exactly: three squarings and three products, all matmuls (no sequential row loop), then
  `newton_steps` Newton refinement steps (prep.chunk_prep takes 2: NUMERICS.md).
  """
  n = L.shape[-1]
  if n > 16:
    raise ValueError(f"invert_unit_lower handles n <= 16, got L of shape {L.shape}")
  eye = jnp.eye(n, dtype=L.dtype)
  inv = eye - L
  power = L
  for _ in range(3):  # L^2, L^4, L^8
    power = jnp.matmul(power, power, precision=_HIGHEST)
    inv = jnp.matmul(inv, eye + power, precision=_HIGHEST)
  # Newton steps X <- X (2I - (I + L) X): the product form loses ~1e-4 when keys are
  # nearly parallel with gates ~ 0 and beta ~ 1; each step squares that residual away.
  for _ in range(newton_steps):
    residual = eye - jnp.matmul(eye + L, inv, precision=_HIGHEST)
    inv = inv + jnp.matmul(inv, residual, precision=_HIGHEST)
  return inv


def mm(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.matmul(a, b, precision=_HIGHEST)


def sub_blocks(x: jax.Array) -> jax.Array:
  """[..., C, F] -> [..., C // 16, 16, F]."""
  return x.reshape(*x.shape[:-2], x.shape[-2] // SUB, SUB, x.shape[-1])


class Decays(NamedTuple):
  """Decay factors of chunks g [..., C, K], from 16-block-local cumsums (no big-minus-big).

  Gl is the inclusive cumsum of g inside each 16-block, so the chunk cumsum is G = P + Gl
  with P the sum over the earlier blocks. Per token [..., nb, 16, K]; per block [..., nb, K].
  """

  gl: jax.Array  # Gl (the unbounded gate's pairwise diagonal blocks)
  rows: jax.Array  # exp(Gl_i - Gl_r0 - shift): row factor of every score of row block r
  cols_diag: jax.Array | None  # exp(Gl_r0 + shift - Gl_j), bounded gate only
  to_end: jax.Array  # exp(Gl_end - Gl_j): token j to the end of its block
  between: jax.Array  # [..., nb, nb, K] exp(G_r0 + shift - G_send) for s < r, else 0
  from_start: jax.Array  # exp(G_i): the chunk start to token i
  block_to_end: jax.Array  # [..., nb, K] exp(G_C - G_send): block end to chunk end
  total: jax.Array  # [..., K] exp(G_C)


def decays(g: jax.Array, lower_bound: float | None) -> Decays:
  """Decay factors of chunks g [..., C, K] (see Decays)."""
  nb = g.shape[-2] // SUB
  Gl = mm(causal_mask(SUB).astype(_f32), sub_blocks(g))
  first, tot = Gl[..., 0, :], Gl[..., -1, :]  # [..., nb, K]
  blk = jnp.arange(nb)
  before = (blk[:, None] > blk[None, :]).astype(_f32)  # [r, s]: s < r
  # G_r0 - G_send = first_r + sum_{s<t<r} tot_t: an exact 0/1 contraction, not a difference
  # of prefix sums.
  strictly_between = ((blk[None, :, None] < blk[None, None, :])
                      & (blk[None, None, :] < blk[:, None, None])).astype(_f32)  # [r, s, t]
  gap = jnp.einsum("rst,...tk->...rsk", strictly_between, tot, precision=_HIGHEST)
  # The bounded gate centres each diagonal block's factor pair (rows, cols_diag) on the
  # block middle; `between` takes the same shift so that products are unchanged.
  shift = 0.0 if lower_bound is None else 0.5 * (SUB - 1) * lower_bound
  rows = jnp.exp(Gl - first[..., None, :] - shift)
  # exp(G_i) = rows_i exp(P_r + first_r + shift): a per-block factor, not a second exp per
  # token. Both factors are normal floats; an underflowing block factor means a product
  # below e^-50 (bounded) or 0 (unbounded), as exp(G_i) itself.
  from_start = rows * jnp.exp(mm(before, tot) + first + shift)[..., None, :]
  if lower_bound is None:
    cols_diag, to_end = None, jnp.exp(tot[..., None, :] - Gl)
  else:
    cols_diag = jnp.exp(first[..., None, :] + shift - Gl)
    # The same trick: both exponents within +-37.5, the product <= 1.
    to_end = cols_diag * jnp.exp(tot - first - shift)[..., None, :]
  return Decays(gl=Gl, rows=rows, cols_diag=cols_diag, to_end=to_end,
                 between=jnp.exp(first[..., :, None, :] + gap + shift) * before[:, :, None],
                 from_start=from_start, block_to_end=jnp.exp(mm(before.T, tot)),
                 total=jnp.exp(jnp.sum(tot, axis=-2)))


def scores(q, k, dec: Decays, keep_qk, keep_kk):
  """A_qk, A_kk: [..., C, C] decay-weighted scores of q, k [..., C, K], zero outside the
  bool masks keep_qk / keep_kk [..., C, C].

  One [16, K] x [K, C] matmul per row block r and row kind: the columns of an earlier block
  s < r carry k_j exp(G_r0 - G_j) = to_end_j between_rs, the diagonal block's columns the
  anchored cols_diag (bounded gate) or nothing, in which case kda_blocks' pairwise
  diagonal blocks are added (any gate <= 0). Never builds a [C, C, K] tensor.
  """
  lead, c = q.shape[:-2], q.shape[-2]
  nb = c // SUB
  ks = sub_blocks(k)
  # cols[r, s, j]: token j of block s as seen from row block r, [..., nb, nb, 16, K].
  cols = (ks * dec.to_end)[..., None, :, :, :] * dec.between[..., :, :, None, :]
  if dec.cols_diag is not None:
    eye = jnp.eye(nb, dtype=_f32)[:, :, None, None]
    cols = cols + eye * (ks * dec.cols_diag)[..., None, :, :, :]
  cols = jnp.swapaxes(cols.reshape(*lead, nb, c, k.shape[-1]), -1, -2)  # [..., nb, K, C]

  diags = (None, None)
  if dec.cols_diag is None:  # q and k rows share one pairwise decay tensor
    diags = diag_block_pairwise(jnp.stack([sub_blocks(q), ks]), ks, dec.gl)  # [2, ..., nb, 16, 16]

  def scores(x, diag, keep):
    a = mm(sub_blocks(x) * dec.rows, cols)  # [..., nb, 16, C]
    if diag is not None:
      eye = jnp.eye(nb, dtype=_f32)[:, None, :, None]
      a = a.reshape(*a.shape[:-1], nb, SUB) + diag[..., :, :, None, :] * eye
    return jnp.where(keep, a.reshape(*lead, c, c), 0.0)

  return scores(q, diags[0], keep_qk), scores(k, diags[1], keep_kk)


def unit_lower_solve(L: jax.Array, rhs: jax.Array, newton_steps: int = 1) -> jax.Array:
  """X = (I + L)^-1 rhs for strictly lower L [..., C, C] and rhs [..., C, F].

  Forward substitution over 16-row blocks: X_r = (I + L_rr)^-1 (rhs_r - L_r,<r X_<r), with
  the 16x16 inverses from the nilpotent product formula (`invert_unit_lower`). Only
  matmuls, so it compiles and differentiates quickly (XLA CPU's batched triangular_solve
  gradient is very slow).
  """
  c = L.shape[-1]
  nb = c // SUB
  diag = jnp.stack([L[..., r * SUB : (r + 1) * SUB, r * SUB : (r + 1) * SUB]
                    for r in range(nb)], axis=-3)  # [..., nb, 16, 16]
  diag_inv = invert_unit_lower(diag, newton_steps)
  xs = []
  for r in range(nb):
    rows = slice(r * SUB, (r + 1) * SUB)
    acc = rhs[..., rows, :]
    if r:
      acc = acc - mm(L[..., rows, : r * SUB], jnp.concatenate(xs, axis=-2))
    xs.append(mm(diag_inv[..., r, :, :], acc))
  return jnp.concatenate(xs, axis=-2)


def intra_chunk_scores(q, k, g, sidx, lower_bound):
  """A_qk, A_kk [..., C, C], zero above the diagonal, of chunks q, k, g [..., C, K].

  The factors come from 16-block cumsums. sidx [..., C] (any dtype) or None: tokens pair
  only with equal sidx (packed segments; the decays come from plain cumsums, right for
  every pair inside a segment, so a mask is all segments need)."""
  keep = causal_mask(q.shape[-2])
  if sidx is not None:
    keep = keep & (sidx[..., :, None] == sidx[..., None, :])
  return scores(q, k, decays(g, lower_bound), keep, keep)
