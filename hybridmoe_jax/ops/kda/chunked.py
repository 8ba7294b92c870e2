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

import jax
import jax.numpy as jnp

from hybridmoe_jax.config import is_int

from pallas_kernels.kda.chunk_xla import (SUB, causal_mask, decays, mm, scores, sub_blocks,
                                          unit_lower_solve)
from pallas_kernels.kda.segments import segment_starts

from ..decay import check_lower_bound
from .recurrent import check_kda_inputs

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
  if not is_int(chunk_size) or chunk_size < SUB or chunk_size & (chunk_size - 1):
    raise ValueError(f"chunk_size must be a power of two >= {SUB}, got {chunk_size!r}")


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
  dec = decays(gch, lower_bound)
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
  a_qk, a_kk = scores(qc, kc, dec, causal, strict)
  decay_in = dec.from_start.reshape(qc.shape)
  k_out = (sub_blocks(kc) * dec.to_end * dec.block_to_end[..., None, :]).reshape(kc.shape)
  state_decay = dec.total[..., None]  # [M, K, 1]
  if carry is not None:
    decay_in = jnp.where(carry, decay_in, 0.0)  # a new segment does not see the state
    k_out = jnp.where(last, k_out, 0.0)  # only the last segment reaches the next chunk
    state_decay = jnp.where(carry[:, -1:], state_decay, 0.0)
  wu = unit_lower_solve(bc * a_kk, jnp.concatenate([bc * kc * decay_in, bc * vc], axis=-1))

  def per_chunk(x):  # [M, ...] -> [B, HV, G, ...]
    return x.reshape(B, HV, ng, *x.shape[1:])

  w, u = per_chunk(wu[..., :K]), per_chunk(wu[..., K:])
  q_in, k_out, a_qk = per_chunk(scale * qc * decay_in), per_chunk(k_out), per_chunk(scale * a_qk)
  state_decay = per_chunk(state_decay)
  # Only W S and the state update are sequential; outputs are batched over the group.
  s_in, v_new = [], []
  for j in range(ng):
    s_in.append(s)
    v_new.append(u[:, :, j] - mm(w[:, :, j], s))
    s = state_decay[:, :, j] * s + mm(jnp.swapaxes(k_out[:, :, j], -1, -2), v_new[-1])
  o = mm(q_in, jnp.stack(s_in, axis=2)) + mm(a_qk, jnp.stack(v_new, axis=2))  # [B,HV,G,C,V]
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
