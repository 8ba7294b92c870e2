"""Chunked KDA in plain XLA (DESIGN s1.1): parallel inside chunks, a scan over chunks.

Conventions: q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV];
state: [B, HV, K, V] float32. Internally everything is float32 in chunk layout
[B*HV, N, C, F] (N chunks of C tokens), each chunk split into C // 16 sub-blocks of 16.
(Ranks are kept <= 7: jaxlib 0.10.2's CPU YNNPACK fusion segfaults on some rank-8 reduces.)
Per chunk, with G the (segment-restarted) inclusive cumsum of g and G_C its last row:
    A_kk, A_qk = decay-weighted k.k / q.k scores (ops/kda_blocks.py for diagonal sub-blocks)
    (I + strict_lower(beta A_kk)) [W | U] = [beta k e^G | beta v]     (blocked substitution)
    scan: Vn = U - W S;  O = (scale q e^G) S + lower(A_qk) Vn;  S = e^G_C S + (k e^(G_C-G))^T Vn
Every exponent that reaches exp is <= 0 (or masked to -inf first), so any gate g <= 0 is safe;
only the optional anchored diagonal path (lower_bound given) relies on bounded gates.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .decay import check_lower_bound
from .kda_blocks import causal_mask, diag_block_anchored, diag_block_pairwise, invert_unit_lower
from .kda_recurrent import check_kda_inputs, segment_starts

_HIGHEST = jax.lax.Precision.HIGHEST
_SUB = 16  # sub-block length: diagonal blocks are 16 x 16
_f32 = jnp.float32


def check_chunk_size(chunk_size: int) -> None:
  """Raises ValueError unless chunk_size is a power of two >= 16."""
  ok = isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, bool)
  if not ok or chunk_size < _SUB or chunk_size & (chunk_size - 1):
    raise ValueError(f"chunk_size must be a power of two >= {_SUB}, got {chunk_size!r}")


class _Segments(NamedTuple):
  """Segment structure in chunk layout [B*HV, N, C] (repeated over value heads)."""

  sidx: jax.Array  # int32 running segment index (0, 1, ...) per token
  carry: jax.Array  # bool: token is in the segment the incoming state belongs to
  last: jax.Array  # bool: token is in the chunk's last segment


def _segments(segment_ids: jax.Array | None, t: int, n: int, c: int, hv: int):
  if segment_ids is None:
    return None
  sidx = jnp.cumsum(segment_starts(segment_ids), axis=1, dtype=jnp.int32)
  # Padding tokens continue the last segment, so the state passes through them unchanged.
  sidx = jnp.pad(sidx, ((0, 0), (0, n * c - t)), mode="edge").reshape(-1, n, c)
  sidx = jnp.repeat(sidx, hv, axis=0)  # [B*HV, N, C], batch-major like the data
  # Segment of the token just before each chunk (chunk 0: its first token's segment).
  prev = jnp.concatenate([sidx[..., :1, 0], sidx[..., :-1, -1]], axis=-1)
  return _Segments(sidx, sidx == prev[..., None], sidx == sidx[..., -1:])


def _masked_exp(x: jax.Array, keep: jax.Array | None) -> jax.Array:
  """exp(x) with masked entries set to 0 by masking the exponent (NaN-free gradients)."""
  return jnp.exp(x if keep is None else jnp.where(keep, x, -jnp.inf))


def _to_chunks(x: jax.Array, n: int, c: int) -> jax.Array:
  """[B, T, HV, ...] -> [B*HV, N, C, ...] float32, zero-padded along T."""
  pad = [(0, 0), (0, n * c - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  x = jnp.pad(x.astype(_f32), pad)
  x = jnp.moveaxis(x.reshape(x.shape[0], n, c, *x.shape[2:]), 3, 1)
  return x.reshape(-1, *x.shape[2:])


def _chunk_cumsum(g: jax.Array, seg: _Segments | None) -> jax.Array:
  """Inclusive cumsum of g over each chunk, restarted at segment starts. [.., C, K].

  A 0/1 lower-triangular mask matmul: a segmented sum without big-minus-big cancellation,
  a matmul on accelerators, and quicker than XLA CPU's reduce-window cumsum."""
  c = g.shape[-2]
  mask = causal_mask(c)
  if seg is not None:
    mask = mask & (seg.sidx[..., :, None] == seg.sidx[..., None, :])
  return jnp.matmul(mask.astype(_f32), g, precision=_HIGHEST)


def _sub(x: jax.Array) -> jax.Array:
  """[..., C, F] -> [..., C // 16, 16, F]."""
  return x.reshape(*x.shape[:-2], x.shape[-2] // _SUB, _SUB, x.shape[-1])


def _intra_chunk_scores(q, k, g, G, sidx, lower_bound):
  """A_qk, A_kk: [..., C, C] decay-weighted scores from q, k, g, G [..., C, K] and segment
  index sidx [..., C] (or None), zero above the diagonal and across segments.

  Never builds a [C, C, K] tensor: off-diagonal 16-blocks are matmuls anchored at the row
  block's first row; diagonal 16-blocks go to kda_blocks."""
  lead, c = q.shape[:-2], q.shape[-2]
  nb = c // _SUB
  # One flat batch dim M keeps every rank <= 7 (see the module docstring).
  q, k, g, G = (x.reshape(-1, c, x.shape[-1]) for x in (q, k, g, G))

  # Off-diagonal blocks (row block r > column block s), anchor a = first row of block r:
  # exp(G_i - G_j) = exp(G_i - G_a) exp(G_a - G_j), both exponents <= 0 for any gate.
  Gr = _sub(G)
  anc = Gr[..., 0, :]  # [M, nb, K]
  col_before = jnp.arange(c)[None, :] < _SUB * jnp.arange(nb)[:, None]  # [nb, C]
  if sidx is None:
    row_keep, col_keep, diag_keep = None, col_before[..., None], None
  else:
    sidx = sidx.reshape(-1, c)
    s = _sub(sidx[..., None])[..., 0]  # [M, nb, 16]
    s_anc = s[..., 0]
    # Only rows/columns in the anchor's segment can pair across blocks; masking the rest
    # also keeps restarted-cumsum exponents (which could be > 0) away from exp.
    row_keep = (s == s_anc[..., None])[..., None]
    col_keep = (col_before & (sidx[..., None, :] == s_anc[..., None]))[..., None]
    diag_keep = s[..., :, None] == s[..., None, :]  # [M, nb, 16, 16]
  row_decay = _masked_exp(Gr - anc[..., None, :], row_keep)  # [M, nb, 16, K]
  # q rows (-> A_qk) and k rows (-> A_kk) share the column factor: one [32, K] x [K, C]
  # matmul per row block.
  row_f = jnp.concatenate([_sub(q) * row_decay, _sub(k) * row_decay], axis=-2)
  col_f = k[..., None, :, :] * _masked_exp(anc[..., None, :] - G[..., None, :, :], col_keep)
  a_off = jnp.matmul(row_f, jnp.swapaxes(col_f, -1, -2), precision=_HIGHEST)  # [M,nb,32,C]

  # Diagonal 16x16 blocks from a block-local cumsum (small magnitudes, exact differences
  # inside a segment; cross-segment pairs are masked by diag_keep).
  Gl = jnp.matmul(causal_mask(_SUB).astype(_f32), _sub(g), precision=_HIGHEST)
  rows = jnp.stack([_sub(q), _sub(k)])  # [2, M, nb, 16, K]
  if lower_bound is None:
    a_diag = diag_block_pairwise(rows, _sub(k), Gl, diag_keep)
  else:
    a_diag = diag_block_anchored(rows, _sub(k), Gl, lower_bound, diag_keep)
  eye = jnp.eye(nb, dtype=_f32)[:, None, :, None]

  def assemble(off, diag):  # [M, nb, 16, C] + block-diagonal [M, nb, 16, 16] -> [.., C, C]
    full = off.reshape(*off.shape[:-1], nb, _SUB) + diag[..., :, :, None, :] * eye
    return full.reshape(*lead, c, c)

  return assemble(a_off[..., :_SUB, :], a_diag[0]), assemble(a_off[..., _SUB:, :], a_diag[1])


def _unit_lower_solve(L: jax.Array, rhs: jax.Array) -> jax.Array:
  """X = (I + L)^-1 rhs for strictly lower L [..., C, C] and rhs [..., C, F].

  Forward substitution over 16-row blocks: X_r = (I + L_rr)^-1 (rhs_r - L_r,<r X_<r), with
  the 16x16 inverses from the nilpotent product formula. Only matmuls, so it compiles and
  differentiates quickly (XLA CPU's batched triangular_solve gradient is very slow).
  """
  c = L.shape[-1]
  nb = c // _SUB
  diag = jnp.stack([L[..., r * _SUB : (r + 1) * _SUB, r * _SUB : (r + 1) * _SUB]
                    for r in range(nb)], axis=-3)  # [..., nb, 16, 16]
  diag_inv = invert_unit_lower(diag)
  xs = []
  for r in range(nb):
    rows = slice(r * _SUB, (r + 1) * _SUB)
    acc = rhs[..., rows, :]
    if r:
      done = jnp.concatenate(xs, axis=-2)  # [..., 16 r, F]
      acc = acc - jnp.matmul(L[..., rows, : r * _SUB], done, precision=_HIGHEST)
    xs.append(jnp.matmul(diag_inv[..., r, :, :], acc, precision=_HIGHEST))
  return jnp.concatenate(xs, axis=-2)


def _across_chunks(w, u, k_out, state_decay, q_in, a_qk, s0):
  """The only sequential part: the state recurrence over chunks.

  Args: w, k_out, q_in [M, N, C, K]; u [M, N, C, V]; state_decay [M, N, K];
    a_qk [M, N, C, C] (scaled, lower-triangular); s0 [M, K, V] float32.
  Returns: o [M, N, C, V] and the final state [M, K, V].
  """

  def step(s, xs):
    w_n, u_n, k_n, d_n = xs
    v_new = u_n - jnp.matmul(w_n, s, precision=_HIGHEST)
    s_next = d_n[..., None] * s + jnp.matmul(
        jnp.swapaxes(k_n, -1, -2), v_new, precision=_HIGHEST
    )
    return s_next, (s, v_new)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (w, u, k_out, state_decay))  # chunk-major
  s_final, (s_in, v_new) = jax.lax.scan(step, s0, xs)
  s_in, v_new = jnp.moveaxis(s_in, 0, 1), jnp.moveaxis(v_new, 0, 1)
  # Outputs need only the state entering each chunk: batched matmuls after the scan.
  o = jnp.matmul(q_in, s_in, precision=_HIGHEST) + jnp.matmul(a_qk, v_new, precision=_HIGHEST)
  return o, s_final


def kda_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    lower_bound: float | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Kimi Delta Attention, chunked form; equal to kda_recurrent up to fp32 rounding.

  Args:
    q, k: [B, T, H, K] L2-normalised queries/keys.
    v: [B, T, HV, V] values, HV a multiple of H.
    g: [B, T, HV, K] log decay <= 0 (within [lower_bound, 0] if lower_bound is given).
    beta: [B, T, HV] write strength.
    scale: query scale; defaults to K ** -0.5.
    initial_state: optional [B, HV, K, V] state for the first token's segment.
    output_final_state: also return the final [B, HV, K, V] float32 state.
    segment_ids: optional [B, T] integer ids; the state resets where the id changes.
    chunk_size: C, a power of two >= 16. Any T works (padded internally).
    lower_bound: if given (in [-5, 0)), the gates are promised to be >= lower_bound and
      the diagonal 16-blocks use one dense matmul instead of the pairwise form.

  Returns:
    (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] float32 or None).
  """
  check_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
  check_chunk_size(chunk_size)
  if lower_bound is not None:
    check_lower_bound(lower_bound)
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  scale = K**-0.5 if scale is None else scale
  c = chunk_size
  n = -(-T // c)
  rep = HV // H
  # Padding with q = k = v = g = beta = 0 makes the extra tokens a no-op on the state.
  qc = _to_chunks(jnp.repeat(q, rep, axis=2), n, c)  # [B*HV, N, C, K]
  kc = _to_chunks(jnp.repeat(k, rep, axis=2), n, c)
  vc = _to_chunks(v, n, c)  # [B*HV, N, C, V]
  gc = _to_chunks(g, n, c)
  bc = _to_chunks(beta, n, c)[..., None]  # [B*HV, N, C, 1]
  seg = _segments(segment_ids, T, n, c, HV)

  G = _chunk_cumsum(gc, seg)
  a_qk, a_kk = _intra_chunk_scores(
      qc, kc, gc, G, None if seg is None else seg.sidx, lower_bound
  )
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  lower = jnp.where(strict, bc * a_kk, 0.0)
  # Rows of a new segment must not see the carried state: their e^G factor is masked.
  carry = None if seg is None else seg.carry[..., None]
  decay_in = _masked_exp(G, carry)
  rhs = jnp.concatenate([bc * kc * decay_in, bc * vc], axis=-1)
  wu = _unit_lower_solve(lower, rhs)
  w, u = wu[..., :K], wu[..., K:]
  q_in = scale * qc * decay_in
  # Only the chunk's last segment reaches the outgoing state.
  last = None if seg is None else seg.last[..., None]
  k_out = kc * _masked_exp(G[..., -1:, :] - G, last)
  state_decay = _masked_exp(G[..., -1, :], None if seg is None else carry[..., -1, :])

  if initial_state is None:
    s0 = jnp.zeros((B * HV, K, V), _f32)
  else:
    s0 = initial_state.astype(_f32).reshape(B * HV, K, V)
  o, s_final = _across_chunks(w, u, k_out, state_decay, q_in, scale * a_qk, s0)
  o = jnp.moveaxis(o.reshape(B, HV, n * c, V), 1, 2)[:, :T].astype(v.dtype)
  return o, (s_final.reshape(B, HV, K, V) if output_final_state else None)
