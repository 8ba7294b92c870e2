"""KDA chunk math shared by the TPU and GPU kernel bodies (runs inside `pallas_call`).

Conventions: one chunk of C = 16 * nb tokens of one (batch, value head), value tile BV.
State in kernel layout St = S^T: [BV, K] float32, so the per-channel decay exp(G_C) is a
[1, K] row broadcast along lanes. Everything is 2-D and every matmul operand has both dims
>= 16, because Triton (GPU) has no value slicing, no concatenation and no small dots: the
forward loads 16-row sub-blocks straight from the refs and keeps per-block values in Python
lists (the sub-block loops are unrolled at trace time).

Forward, per chunk (DESIGN s1.1-1.2), with G the inclusive cumsum of g over the chunk:
    A[i, j] = sum_c x_i[c] k_j[c] exp(G_i[c] - G_j[c])        x = q (A_qk) or k (A_kk)
      diagonal 16-block r:      anchor G_{16r} + 0.5 * 15 * lb (causal: row 0 of the block)
      off-diagonal (s < r):     anchor G_{16r}, both factors' exponents <= 0 for any gate
    (I + strict(beta A_kk)) Vn = beta v - beta k e^G S       16-block substitution, diagonal
                                                              inverses by Neumann products
    O = (scale q e^G) S + scale lower(A_qk) Vn;  S <- e^G_C S + (k e^(G_C-G))^T Vn
(Vn = U - W S of DESIGN s1.1 with W, U never formed: one solve instead of two.)
Packed sequences (packed=True) keep the plain chunk cumsum and add 0/1 segment masks only
(see forward_chunk): every exponent stays a sum of gates, so the bounds above still hold.
The split forward's recurrence (`output_chunk`) works on whole-chunk [C, F] tensors
precomputed in XLA (prep.chunk_prep).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

SUB = 16  # sub-block rows: diagonal blocks are 16 x 16
_f32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST


def mm(a, b, prec):
  """a [m, k] @ b [k, n] in float32."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=prec,
                         preferred_element_type=_f32)


def mm_nt(a, b, prec):
  """a [m, k] @ b[n, k]^T in float32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                         preferred_element_type=_f32)


def mm_tn(a, b, prec):
  """a[k, m]^T @ b [k, n] in float32."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=prec,
                         preferred_element_type=_f32)


def _masks(k: int):
  i = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  j = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  first = lax.broadcasted_iota(jnp.int32, (SUB, k), 0) == 0
  return i >= j, i > j, jnp.where(i == j, 1.0, 0.0).astype(_f32), first


def invert_unit_lower16(L, eye):
  """(I + L)^-1 of a strictly lower 16 x 16 block, always at HIGHEST precision.

  Neumann product (I - L)(I + L^2)(I + L^4)(I + L^8) (exact: L^16 = 0; the formula of
  chunk_xla.invert_unit_lower), then one Newton step T <- T + T (I - (I + L) T): a
  no-op in exact arithmetic that squares the rounding residual. It matters when keys are
  nearly identical and decays ~1: then L ~ strict ones, L^8 has entries up to C(14, 7) =
  3432 and the product alone loses ~4e-4 absolute (NUMERICS.md).
  """
  inv = eye - L
  power = L
  for _ in range(3):
    power = mm(power, power, _HIGHEST)
    inv = mm(inv, eye + power, _HIGHEST)
  return inv + mm(inv, eye - mm(eye + L, inv, _HIGHEST), _HIGHEST)


def _row(x, i):
  """Row i of a [16, F] value as [1, F] (Triton cannot slice values: a masked sum)."""
  pick = lax.broadcasted_iota(jnp.int32, x.shape, 0) == i
  return jnp.sum(jnp.where(pick, x, 0.0), axis=0, keepdims=True)


def _same_segment(s, eye):
  """[16, 16] bool: s_i == s_j for a [16, 1] column of segment indices. The row form s^T
  comes from a matmul with the identity (exact for small integers at HIGHEST), which both
  backends lower without a transpose of a [16, 1] value."""
  cols = jnp.broadcast_to(s, (SUB, SUB))
  return cols == mm_tn(cols, eye, _HIGHEST)


def forward_chunk(
    load: Callable[[str, int], jax.Array],
    store: Callable[[int, jax.Array], None],
    St: jax.Array,
    *,
    nb: int,
    lower_bound: float,
    scale: float,
    prec,
    packed: bool = False,
) -> jax.Array:
  """One chunk of the fused forward; returns the next state St [BV, K] float32.

  Args:
    load: load(name, r) -> sub-block r (rows 16r..16r+15) of name in {"q", "k", "g"}
      ([16, K]), "v" ([16, BV]), "beta" ([16, 1]) or, if packed, "seg" ([16, 1]: the
      chunk-local segment index of segments.py), as float32.
    store: store(r, o) writes output rows 16r..16r+15 (o: [16, BV] float32).
    St: incoming state, transposed: [BV, K] float32.
    nb: sub-blocks per chunk (C = 16 nb).
    lower_bound: the bounded gate's lb (gates in [lb, 0]); sets the diagonal anchor offset.
    scale: query scale.
    prec: lax precision of the matmuls (the cumsum and the 16 x 16 inverses are
      always HIGHEST).
    packed: mask by segment (prep.chunk_prep explains why the plain cumsum stays
      exact): rows with seg > 0 do not see St, only rows in the chunk's last segment write
      the next state, St is dropped if the chunk holds a start, and scores pair tokens of
      one segment only. False compiles none of it.
  """
  K = St.shape[1]
  causal, strict, eye, first = _masks(K)
  tril = jnp.where(causal, 1.0, 0.0).astype(_f32)
  offset = 0.5 * (SUB - 1) * float(lower_bound)  # diagonal anchor offset (<= 0)

  # Pass 1: block-local cumsums (exact small sums) and the chunk cumsum G = base + Gl.
  Gl, g0, base = [], [], []
  carry = jnp.zeros((1, K), _f32)
  for r in range(nb):
    g = load("g", r)
    Gl.append(mm(tril, g, _HIGHEST))
    g0.append(jnp.sum(jnp.where(first, g, 0.0), axis=0, keepdims=True))  # Gl[0]
    base.append(carry)
    carry = carry + jnp.sum(g, axis=0, keepdims=True)
  G_C = carry  # [1, K]: the chunk's total log decay
  state_decay = jnp.exp(G_C)
  if packed:
    seg = [load("seg", r) for r in range(nb)]  # [16, 1] each
    seg_last = _row(seg[-1], SUB - 1)  # [1, 1]: the chunk's last segment
    state_decay = jnp.where(seg_last == 0.0, state_decay, 0.0)

  def keep(x, mask):  # x masked by a segment condition (every exponent here is <= 0)
    return x if mask is None else jnp.where(mask, x, 0.0)

  # Pass 2, one 16-row block at a time. The fused kernel never forms W and U: with the
  # state S entering the chunk, Vn = U - W S = (I + L)^-1 (beta v - beta k e^G S), so one
  # blocked solve gives Vn directly and only the earlier blocks' Vn stay live.
  v_new = []
  St_next = St * state_decay
  for r in range(nb):
    sees_state = same = in_anchor = seg_anchor = writes_state = None
    if packed:
      sees_state = seg[r] == 0.0  # [16, 1]
      same = _same_segment(seg[r], eye)
      seg_anchor = _row(seg[r], 0)  # [1, 1]: the segment of the block's first row
      in_anchor = seg[r] == seg_anchor
      writes_state = seg[r] == seg_last
    q = load("q", r) * scale
    k = load("k", r)
    b = load("beta", r)  # [16, 1]
    G = Gl[r] + base[r]
    decay_in = keep(jnp.exp(G), sees_state)  # <= 1
    # Diagonal block: anchor x = Gl[0] + offset depends on row 0 only (causal); both
    # factors' exponents lie in [-7.5|lb|, 7.5|lb|] for gates in [lb, 0].
    up = jnp.exp(Gl[r] - g0[r] - offset)
    down = k * jnp.exp(g0[r] + offset - Gl[r])
    diag_causal = causal if same is None else causal & same
    diag_strict = strict if same is None else strict & same
    aqk = [None] * (r + 1)
    aqk[r] = jnp.where(diag_causal, mm_nt(q * up, down, prec), 0.0)
    L_rr = b * jnp.where(diag_strict, mm_nt(k * up, down, prec), 0.0)
    rhs = b * load("v", r) - mm_nt(b * k * decay_in, St, prec)  # [16, BV]
    # Off-diagonal blocks s < r: anchor G_{16r}; exp(Gl - Gl[0]) <= 1 and
    # exp(G_{16r} - G_j) <= 1 for j < 16r. Packed: a row after a start inside block r
    # pairs with no earlier block, and a column pairs only if in the anchor's segment.
    ef = keep(jnp.exp(Gl[r] - g0[r]), in_anchor)
    qo, ko = q * ef, k * ef
    anchor = base[r] + g0[r]
    for s in range(r):
      cols = load("k", s) * jnp.exp(anchor - (Gl[s] + base[s]))
      cols = keep(cols, None if seg_anchor is None else seg[s] == seg_anchor)
      aqk[s] = mm_nt(qo, cols, prec)
      rhs = rhs - mm(b * mm_nt(ko, cols, prec), v_new[s], prec)
    v_new.append(mm(invert_unit_lower16(L_rr, eye), rhs, prec))
    # Output rows of block r: O = q e^G S + sum_{s <= r} A_qk[r, s] Vn_s.
    o = mm_nt(q * decay_in, St, prec)
    for s in range(r + 1):
      o = o + mm(aqk[s], v_new[s], prec)
    store(r, o)
    k_out = k * keep(jnp.exp(G_C - G), writes_state)
    St_next = St_next + mm_tn(v_new[r], k_out, prec)
  return St_next


def chunk_apply(x: dict, St: jax.Array, seg, *, nb: int, lower_bound: float, scale: float,
                prec) -> tuple[list[jax.Array], jax.Array]:
  """forward_chunk as a pure function of values (so jax.vjp can differentiate it inside a
  kernel): x maps "q", "k", "g" to nb [16, K] blocks, "v" to nb [16, BV] blocks and "beta"
  to nb [16, 1] blocks (float32); seg: nb [16, 1] blocks or None (unpacked; never
  differentiated). Returns (nb output blocks [16, BV], the next state St [BV, K]).

  Taking blocks (not [C, F] values) keeps slicing, and its transpose (a pad), out of the
  differentiated code: the kernels read and write 16-row sub-blocks of their refs directly.
  """
  out = []

  def load(name, r):
    return seg[r] if name == "seg" else x[name][r]

  St_next = forward_chunk(load, lambda r, o: out.append(o), St, nb=nb,
                          lower_bound=lower_bound, scale=scale, prec=prec,
                          packed=seg is not None)
  return out, St_next


def states_chunk(w, u, k_out, decay, St, prec):
  """State after one chunk from precomputed W, k_out [C, K], U [C, BV], decay [1, K]."""
  v_new = u - mm_nt(w, St, prec)
  return St * decay + mm_tn(v_new, k_out, prec)


def output_chunk(w, u, q_in, k_out, a_qk, decay, St, prec):
  """Outputs [C, BV] and the next state of one chunk from precomputed chunk quantities
  (the split forward: prep.chunk_prep in XLA, then this recurrence in Pallas)."""
  v_new = u - mm_nt(w, St, prec)
  o = mm_nt(q_in, St, prec) + mm(a_qk, v_new, prec)
  return o, St * decay + mm_tn(v_new, k_out, prec)

