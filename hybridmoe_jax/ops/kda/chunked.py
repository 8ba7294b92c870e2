"""Chunked KDA in plain XLA (DESIGN s1.1): parallel inside chunks, a scan over chunks.

Conventions: q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV];
state: [B, HV, K, V] float32. Chunks of C tokens, each split into C // 16 blocks of 16.
Per chunk, with G the inclusive cumsum of g over the chunk and G_C its last row:
    A_kk, A_qk = decay-weighted k.k / q.k scores (causal, within a segment)
    (I + strict_lower(beta A_kk)) [W | U] = [beta k e^G | beta v]     (blocked substitution)
    Vn = U - W S;  O = (scale q e^G) S + lower(A_qk) Vn;  S = e^G_C S + (k e^(G_C-G))^T Vn
All of it runs inside one lax.scan step per group of chunks (64+ tokens): each step reads its tokens
once and keeps every chunk-local intermediate in cache (on CPU the vectorised form was
bound by ~30 full-size memory passes, not by its matmuls). Decays are factored through
16-block boundaries with exponents <= 0, so any gate g <= 0 is safe; only the bounded gate's
anchored diagonal blocks (lower_bound given) use exponents up to (15/2)|lb| <= 37.5.
(Ranks are kept <= 7: jaxlib 0.10.2's CPU YNNPACK fusion segfaults on some rank-8 reduces.)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybridmoe_jax.config import is_int

from ..decay import check_lower_bound
from .blocks import causal_mask, diag_block_pairwise, invert_unit_lower
from .recurrent import check_kda_inputs, segment_starts

_HIGHEST = jax.lax.Precision.HIGHEST
_SUB = 16  # block length: diagonal blocks are 16 x 16
# Tokens per scan step: at least 64 and 2 whole chunks. Measured on CPU (T=4096, C=32/64):
# smaller steps keep the forward in cache, two chunks per step amortise the backward's
# per-step cost (64 -> 128 tokens at C=32: fwd 13.0 -> 16.3 ms; at C=64 one chunk per step
# made fwd+bwd 1.7x slower).
_STEP_TOKENS = 64
_f32 = jnp.float32


def forward_flops(tokens: int, heads: int, K: int, V: int, chunk: int) -> int:
  """Forward FLOPs of chunked KDA (DESIGN s1.3b; multiply-add = 2); fwd + bwd is ~3x."""
  return tokens * heads * (6 * chunk * K + 4 * chunk * V + 6 * K * V)


def check_chunk_size(chunk_size: int) -> None:
  """Raises ValueError unless chunk_size is a power of two >= 16."""
  if not is_int(chunk_size) or chunk_size < _SUB or chunk_size & (chunk_size - 1):
    raise ValueError(f"chunk_size must be a power of two >= {_SUB}, got {chunk_size!r}")


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.matmul(a, b, precision=_HIGHEST)


def _sub(x: jax.Array) -> jax.Array:
  """[..., C, F] -> [..., C // 16, 16, F]."""
  return x.reshape(*x.shape[:-2], x.shape[-2] // _SUB, _SUB, x.shape[-1])


class _Decays(NamedTuple):
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


def _decays(g: jax.Array, lower_bound: float | None) -> _Decays:
  """Decay factors of chunks g [..., C, K] (see _Decays)."""
  nb = g.shape[-2] // _SUB
  Gl = _mm(causal_mask(_SUB).astype(_f32), _sub(g))
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
  shift = 0.0 if lower_bound is None else 0.5 * (_SUB - 1) * lower_bound
  rows = jnp.exp(Gl - first[..., None, :] - shift)
  # exp(G_i) = rows_i exp(P_r + first_r + shift): a per-block factor, not a second exp per
  # token. Both factors are normal floats; an underflowing block factor means a product
  # below e^-50 (bounded) or 0 (unbounded), as exp(G_i) itself.
  from_start = rows * jnp.exp(_mm(before, tot) + first + shift)[..., None, :]
  if lower_bound is None:
    cols_diag, to_end = None, jnp.exp(tot[..., None, :] - Gl)
  else:
    cols_diag = jnp.exp(first[..., None, :] + shift - Gl)
    # The same trick: both exponents within +-37.5, the product <= 1.
    to_end = cols_diag * jnp.exp(tot - first - shift)[..., None, :]
  return _Decays(gl=Gl, rows=rows, cols_diag=cols_diag, to_end=to_end,
                 between=jnp.exp(first[..., :, None, :] + gap + shift) * before[:, :, None],
                 from_start=from_start, block_to_end=jnp.exp(_mm(before.T, tot)),
                 total=jnp.exp(jnp.sum(tot, axis=-2)))


def _scores(q, k, dec: _Decays, keep_qk, keep_kk):
  """A_qk, A_kk: [..., C, C] decay-weighted scores of q, k [..., C, K], zero outside the
  bool masks keep_qk / keep_kk [..., C, C].

  One [16, K] x [K, C] matmul per row block r and row kind: the columns of an earlier block
  s < r carry k_j exp(G_r0 - G_j) = to_end_j between_rs, the diagonal block's columns the
  anchored cols_diag (bounded gate) or nothing, in which case kda_blocks' pairwise
  diagonal blocks are added (any gate <= 0). Never builds a [C, C, K] tensor.
  """
  lead, c = q.shape[:-2], q.shape[-2]
  nb = c // _SUB
  ks = _sub(k)
  # cols[r, s, j]: token j of block s as seen from row block r, [..., nb, nb, 16, K].
  cols = (ks * dec.to_end)[..., None, :, :, :] * dec.between[..., :, :, None, :]
  if dec.cols_diag is not None:
    eye = jnp.eye(nb, dtype=_f32)[:, :, None, None]
    cols = cols + eye * (ks * dec.cols_diag)[..., None, :, :, :]
  cols = jnp.swapaxes(cols.reshape(*lead, nb, c, k.shape[-1]), -1, -2)  # [..., nb, K, C]

  diags = (None, None)
  if dec.cols_diag is None:  # q and k rows share one pairwise decay tensor
    diags = diag_block_pairwise(jnp.stack([_sub(q), ks]), ks, dec.gl)  # [2, ..., nb, 16, 16]

  def scores(x, diag, keep):
    a = _mm(_sub(x) * dec.rows, cols)  # [..., nb, 16, C]
    if diag is not None:
      eye = jnp.eye(nb, dtype=_f32)[:, None, :, None]
      a = a.reshape(*a.shape[:-1], nb, _SUB) + diag[..., :, :, None, :] * eye
    return jnp.where(keep, a.reshape(*lead, c, c), 0.0)

  return scores(q, diags[0], keep_qk), scores(k, diags[1], keep_kk)


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
      acc = acc - _mm(L[..., rows, : r * _SUB], jnp.concatenate(xs, axis=-2))
    xs.append(_mm(diag_inv[..., r, :, :], acc))
  return jnp.concatenate(xs, axis=-2)


# The per-chunk interface that pallas_kernels/kda/reference.py builds on: chunk layout
# [B*HV, N, C, F]; segments as a per-token index whose equal values may interact.


def split_chunks(x: jax.Array, n: int, c: int) -> jax.Array:
  """[B, T, HV, ...] -> [B*HV, N, C, ...] float32, zero-padded along T."""
  pad = [(0, 0), (0, n * c - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  x = jnp.pad(x.astype(_f32), pad)
  x = jnp.moveaxis(x.reshape(x.shape[0], n, c, *x.shape[2:]), 3, 1)
  return x.reshape(-1, *x.shape[2:])


def chunk_cumsum(g: jax.Array, seg: None) -> jax.Array:
  """Inclusive cumsum G of chunks g [..., C, K] (seg must be None), from block cumsums."""
  if seg is not None:
    raise NotImplementedError("chunk_cumsum: segments are masked by kda_chunked, not here")
  nb = g.shape[-2] // _SUB
  Gl = _mm(causal_mask(_SUB).astype(_f32), _sub(g))
  before = jnp.tril(jnp.ones((nb, nb), _f32), -1)
  return (_mm(before, Gl[..., -1, :])[..., None, :] + Gl).reshape(g.shape)


def intra_chunk_scores(q, k, g, G, sidx, lower_bound):
  """A_qk, A_kk [..., C, C], zero above the diagonal, of chunks q, k, g [..., C, K].

  G (the chunk cumsum) is not needed: the factors come from 16-block cumsums. sidx
  [..., C] (any dtype) or None: tokens pair only with equal sidx (packed segments; the
  decays come from plain cumsums, right for every pair inside a segment, so a mask is all
  segments need)."""
  del G
  keep = causal_mask(q.shape[-2])
  if sidx is not None:
    keep = keep & (sidx[..., :, None] == sidx[..., None, :])
  return _scores(q, k, _decays(g, lower_bound), keep, keep)


def _group_step(s, xs, *, c, scale, lower_bound):
  """One scan step: a group of G chunks. s: [B, HV, K, V] state entering the group.

  xs: q, k [B, G*C, H, K]; v [B, G*C, HV, V]; g [B, G*C, HV, K]; beta [B, G*C, HV];
  sidx [B, G*C] running segment index and prev [B] the segment of the token before the
  group (both None without segments). Returns (state leaving the group, o [B, G*C, HV, V]).
  """
  q, k, v, g, beta, sidx, prev = xs
  B, gc, HV = v.shape[:3]
  K, V = q.shape[-1], v.shape[-1]
  ng = gc // c
  m = B * HV * ng  # one flat batch dim keeps every rank <= 7 (module docstring)

  def chunks(x):  # [B, G*C, HV', F] -> [B*HV*G, C, F] float32, q/k heads repeated
    x = jnp.moveaxis(x.astype(_f32).reshape(B, ng, c, *x.shape[2:]), 3, 1)
    return jnp.repeat(x, HV // x.shape[1], axis=1).reshape(m, c, x.shape[-1])

  qc, kc, vc, gch = chunks(q), chunks(k), chunks(v), chunks(g)
  bc = chunks(beta[..., None])  # [M, C, 1]
  dec = _decays(gch, lower_bound)
  causal = causal_mask(c)
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  carry = last = None
  if sidx is not None:
    # Decays use plain cumsums: right for every pair inside a segment, so segments need
    # only masks (scores across segments, carried rows, last-segment keys).
    entering = jnp.concatenate([prev[:, None], sidx.reshape(B, ng, c)[:, :-1, -1]], axis=1)
    sc, entering = (jnp.broadcast_to(x.reshape(B, 1, ng, -1), (B, HV, ng, x.size // B // ng))
                    .reshape(m, -1) for x in (sidx, entering))  # [M, C], [M, 1]
    same = sc[:, :, None] == sc[:, None, :]
    causal, strict = causal & same, strict & same
    carry = (sc == entering)[..., None]  # [M, C, 1]
    last = (sc == sc[:, -1:])[..., None]
  a_qk, a_kk = _scores(qc, kc, dec, causal, strict)
  decay_in = dec.from_start.reshape(qc.shape)
  k_out = (_sub(kc) * dec.to_end * dec.block_to_end[..., None, :]).reshape(kc.shape)
  state_decay = dec.total[..., None]  # [M, K, 1]
  if carry is not None:
    decay_in = jnp.where(carry, decay_in, 0.0)  # a new segment does not see the state
    k_out = jnp.where(last, k_out, 0.0)  # only the last segment reaches the next chunk
    state_decay = jnp.where(carry[:, -1:], state_decay, 0.0)
  wu = _unit_lower_solve(bc * a_kk, jnp.concatenate([bc * kc * decay_in, bc * vc], axis=-1))

  def per_chunk(x):  # [M, ...] -> [B, HV, G, ...]
    return x.reshape(B, HV, ng, *x.shape[1:])

  w, u = per_chunk(wu[..., :K]), per_chunk(wu[..., K:])
  q_in, k_out, a_qk = per_chunk(scale * qc * decay_in), per_chunk(k_out), per_chunk(scale * a_qk)
  state_decay = per_chunk(state_decay)
  # Only W S and the state update are sequential; outputs are batched over the group.
  s_in, v_new = [], []
  for j in range(ng):
    s_in.append(s)
    v_new.append(u[:, :, j] - _mm(w[:, :, j], s))
    s = state_decay[:, :, j] * s + _mm(jnp.swapaxes(k_out[:, :, j], -1, -2), v_new[-1])
  o = _mm(q_in, jnp.stack(s_in, axis=2)) + _mm(a_qk, jnp.stack(v_new, axis=2))  # [B,HV,G,C,V]
  return s, jnp.moveaxis(o, 1, 3).reshape(B, gc, HV, V)


def step_tokens(T: int, c: int) -> int:
  """Tokens per scan step of `kda_chunked` (chunk size c, length T): whole chunks, at least
  64 tokens and 2 chunks, at most as many as the (padded) sequence has."""
  return c * min(max(2, _STEP_TOKENS // c), -(-T // c))


def scan_steps(T: int, c: int) -> int:
  """Steps of `kda_chunked`'s scan over a length-T sequence (chunk size c)."""
  return -(-T // step_tokens(T, c))


def kda_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                scale: float | None = None, initial_state: jax.Array | None = None,
                output_final_state: bool = False, segment_ids: jax.Array | None = None,
                chunk_size: int = 64, lower_bound: float | None = None
                ) -> tuple[jax.Array, jax.Array | None]:
  """Kimi Delta Attention, chunked form; equal to kda_recurrent up to fp32 rounding.

  Arguments and result as `ops.kda.kda`'s (shapes in the module docstring). chunk_size: C, a
  power of two >= 16 (any T works, padded internally). lower_bound: if given (in [-5, 0)),
  the gates are promised to be >= lower_bound and the diagonal 16-blocks use one dense
  matmul instead of the pairwise form.
  """
  check_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
  check_chunk_size(chunk_size)
  if lower_bound is not None:
    check_lower_bound(lower_bound)
  B, T, _, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  scale = K**-0.5 if scale is None else scale
  c = chunk_size
  gc, steps = step_tokens(T, c), scan_steps(T, c)
  tp = steps * gc

  def groups(x, mode="constant"):  # [B, T, ...] -> [steps, B, G*C, ...], padded
    if tp != T:
      x = jnp.pad(x, [(0, 0), (0, tp - T)] + [(0, 0)] * (x.ndim - 2), mode=mode)
    return jnp.moveaxis(x.reshape(B, steps, gc, *x.shape[2:]), 1, 0)

  if segment_ids is None:
    sidx = prev = None
  else:
    run = jnp.cumsum(segment_starts(segment_ids), axis=1, dtype=jnp.int32)
    # Padding tokens continue the last segment, so the state passes through them unchanged.
    sidx = groups(run, mode="edge")  # [steps, B, G*C]
    prev = jnp.concatenate([sidx[:1, :, 0], sidx[:-1, :, -1]], axis=0)  # [steps, B]
  # Zero-padded tokens (q = k = v = g = beta = 0) leave the state unchanged.
  xs = (groups(q), groups(k), groups(v), groups(g), groups(beta), sidx, prev)
  if initial_state is None:
    s0 = jnp.zeros((B, HV, K, V), _f32)
  else:
    s0 = initial_state.astype(_f32)

  def step(s, x):
    return _group_step(s, x, c=c, scale=scale, lower_bound=lower_bound)

  # The backward recomputes each step's chunk-local quantities from its inputs and entering
  # state instead of storing them all (on CPU ~2x faster fwd+bwd, and far less memory).
  s_final, o = jax.lax.scan(jax.checkpoint(step), s0, xs)
  o = jnp.moveaxis(o, 0, 1).reshape(B, tp, HV, V)[:, :T].astype(v.dtype)
  return o, (s_final if output_final_state else None)
