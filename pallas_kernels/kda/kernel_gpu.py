"""KDA kernels for GPU: Pallas with the Triton compiler (`plgpu.CompilerParams`).

Fused forward (`forward`, GpuConfig(fused=True)): one program per (batch, value head, value
tile of BV) walks the chunks in a `lax.fori_loop`, its fp32 state tile St = S^T [BV, K] the
loop carry (registers: Triton has no scratch memory); chunks and 16-row sub-blocks are read
with `pl.ds` (Triton cannot slice values). Layouts (prepared by api.py): q, k [B, H, Tp, K];
v [B, HV, Tp, V]; g [B, HV, Tp, K] f32; beta [B, HV, Tp, 1] f32.

Split path (the default): XLA's chunk_prep (prep.py, chunk layout [B*HV, N, C, F]), then
sequential passes over chunks (states; state gradients, in reverse) carrying S [K, 8]
(STATE_BV), and chunk-parallel kernels (outputs; two gradient kernels), all run one slice of
SLICE_CHUNKS chunks at a time (`sliced_forward`, `sliced_backward`) so XLA's temporaries are
one slice's. States are stored transposed [.., V, K] f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .chunk_math import SUB, forward_chunk, mm, mm_nt, mm_tn
from .config import GpuConfig, lax_precision

_f32 = jnp.float32


def _params(cfg: GpuConfig):
  return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def forward(q, k, v, g, beta, h0t, seg=None, *, cfg: GpuConfig, scale: float,
            lower_bound: float, interpret: bool):
  """Fused forward. Returns (o [B, HV, Tp, V] in v's dtype, final St [B, HV, V, K] f32).

  seg: optional [B, Tp, 1] float32 chunk-local segment index (packed sequences)."""
  B, H, Tp, K = q.shape
  HV, V = v.shape[1], v.shape[3]
  rep, C, BV = HV // H, cfg.chunk_size, cfg.block_v
  prec = lax_precision(cfg.precision)
  packed = seg is not None

  def kernel(*refs):
    if packed:
      q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, seg_ref, o_ref, ht_ref = refs
    else:
      q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, ht_ref = refs
      seg_ref = None
    refs = dict(q=q_ref, k=k_ref, v=v_ref, g=g_ref, beta=b_ref, seg=seg_ref)

    def body(n, St):
      base = pl.multiple_of(n * C, C)

      def load(name, r):
        return refs[name][pl.ds(base + SUB * r, SUB), :].astype(_f32)

      def store(r, o):
        o_ref[pl.ds(base + SUB * r, SUB), :] = o.astype(o_ref.dtype)

      return forward_chunk(load, store, St, nb=C // SUB, lower_bound=lower_bound,
                           scale=scale, prec=prec, packed=packed)

    ht_ref[...] = lax.fori_loop(0, Tp // C, body, h0_ref[...].astype(_f32))

  qk_spec = pl.BlockSpec((None, None, Tp, K), lambda b, h, j: (b, h // rep, 0, 0))
  hk_spec = pl.BlockSpec((None, None, Tp, K), lambda b, h, j: (b, h, 0, 0))
  tile_spec = pl.BlockSpec((None, None, Tp, BV), lambda b, h, j: (b, h, 0, j))
  state_spec = pl.BlockSpec((None, None, BV, K), lambda b, h, j: (b, h, j, 0))
  in_specs = [qk_spec, qk_spec, tile_spec, hk_spec,
              pl.BlockSpec((None, None, Tp, 1), lambda b, h, j: (b, h, 0, 0)), state_spec]
  extra = ()
  if packed:  # one segment index per token, shared by all heads
    in_specs.append(pl.BlockSpec((None, Tp, 1), lambda b, h, j: (b, 0, 0)))
    extra = (seg,)
  return pl.pallas_call(
      kernel,
      grid=(B, HV, V // BV),
      in_specs=in_specs,
      out_specs=[tile_spec, state_spec],
      out_shape=[jax.ShapeDtypeStruct((B, HV, Tp, V), v.dtype),
                 jax.ShapeDtypeStruct((B, HV, V, K), _f32)],
      compiler_params=_params(cfg),
      interpret=interpret,
      name="kda_fwd_packed_gpu" if packed else "kda_fwd_gpu",
  )(q, k, v, g, beta, h0t, *extra)


def _parallel_params(cfg: GpuConfig):
  """The chunk-parallel kernels hold whole [C, K] fp32 tiles: 8 warps (at least) spread them
  over enough threads to stay in registers."""
  return plgpu.CompilerParams(num_warps=max(cfg.num_warps, 8), num_stages=cfg.num_stages)


# The value tile of the two sequential passes (states forward, state gradients backward).
# Value columns of the state recur independently (Vn = U - W S contracts K, not V), so these
# passes split V as finely as a dot allows: 8 columns, in the layout S [K, 8], make every
# product an m64n8 / m128n8 tile (N = 8 is a native tensor-core width; an M of 8 is not: the
# transposed layout St [8, K] spilled 3.3 KB). At B=1, H=16, V=128 that is 256 programs for
# 132 SMs, where tiles of 16 gave 128 (ptxas for sm_90: 126 / 162 registers, no spills).
STATE_BV = 8


def _sequential_pass(body, ins, sides: str, s0t, *, reverse: bool, name: str,
                     cfg: GpuConfig, interpret: bool):
  """A sequential pass over the chunk layout [BH, N, C, F] (ins[0] is [BH, N, C, K]), grid
  (BH, V // bv), bv = min(STATE_BV, V): the carry S [K, bv] (a state or a state gradient)
  starts from s0t [BH, V, K] and walks the N chunks, last first if `reverse`;
  body(n, S, *refs) -> the carry after chunk n, refs those of `ins`, whose blocks `sides`
  names per input: "k" K-side chunks, "v" value-side chunks, "a" [C, C] chunks, "d" the
  decay as a column [N, K, 1] (it scales the rows of S). Returns the carry entering every
  chunk [BH, N, V, K] f32 and the last one [BH, V, K] f32, in the transposed layout of the
  other kernels."""
  BH, N, C, K = ins[0].shape
  V = s0t.shape[1]
  bv = min(STATE_BV, V)
  specs = dict(k=pl.BlockSpec((None, N, C, K), lambda i, j: (i, 0, 0, 0)),
               v=pl.BlockSpec((None, N, C, bv), lambda i, j: (i, 0, 0, j)),
               a=pl.BlockSpec((None, N, C, C), lambda i, j: (i, 0, 0, 0)),
               d=pl.BlockSpec((None, N, K, 1), lambda i, j: (i, 0, 0, 0)))
  state = pl.BlockSpec((None, bv, K), lambda i, j: (i, j, 0))

  def kernel(*refs):
    *in_refs, s0_ref, carries_ref, last_ref = refs

    def step(i, S):
      n = N - 1 - i if reverse else i
      carries_ref[n] = S.T
      return body(n, S, *in_refs)

    last_ref[...] = lax.fori_loop(0, N, step, s0_ref[...].T).T

  return pl.pallas_call(
      kernel,
      grid=(BH, V // bv),
      in_specs=[specs[side] for side in sides] + [state],
      out_specs=[pl.BlockSpec((None, N, bv, K), lambda i, j: (i, 0, j, 0)), state],
      out_shape=[jax.ShapeDtypeStruct((BH, N, V, K), _f32),
                 jax.ShapeDtypeStruct((BH, V, K), _f32)],
      compiler_params=_params(cfg),
      interpret=interpret,
      name=name,
  )(*ins, s0t)


def _states_and_final(w, u, k_out, decay, s0t, *, cfg: GpuConfig, interpret: bool):
  """The sequential pass: the state entering each chunk, St [BH, N, V, K] f32, and the final
  state [BH, V, K] f32. Per chunk two [C, K] x [K, 8] products: the light part of the
  recurrence (chunk_prep did the 16 x 16 solves, chunk-parallel, in XLA). The carry is
  S = St^T [K, 8] (see STATE_BV); states are stored transposed."""
  BH, N, _, K = w.shape
  prec = lax_precision(cfg.precision)

  def body(n, S, w_ref, u_ref, ko_ref, d_ref):
    v_new = u_ref[n] - mm(w_ref[n], S, prec)
    return S * d_ref[n] + mm_tn(ko_ref[n], v_new, prec)

  return _sequential_pass(body, (w, u, k_out, decay.reshape(BH, N, K, 1)), "kvkd", s0t,
                          reverse=False, name="kda_states_gpu", cfg=cfg, interpret=interpret)


def _outputs(w, u, q_in, a_qk, st, *, out_dtype, cfg: GpuConfig, interpret: bool):
  """Chunk-parallel outputs o [BH, N, C, V] = q_in S + A (U - W S) with S the state entering
  each chunk (st [BH, N, V, K], transposed): one program per (head, chunk, value tile)."""
  BH, N, C, K = w.shape
  V, BV = u.shape[-1], cfg.block_v
  prec = lax_precision(cfg.precision)
  # Over the chunk layout [BH, N, C, F], grid (BH, N, V // BV).
  k_side = pl.BlockSpec((None, None, C, K), lambda i, n, j: (i, n, 0, 0))
  v_side = pl.BlockSpec((None, None, C, BV), lambda i, n, j: (i, n, 0, j))
  a_spec = pl.BlockSpec((None, None, C, C), lambda i, n, j: (i, n, 0, 0))
  state = pl.BlockSpec((None, None, BV, K), lambda i, n, j: (i, n, j, 0))

  def kernel(w_ref, u_ref, qi_ref, a_ref, st_ref, o_ref):
    St = st_ref[...]
    v_new = u_ref[...] - mm_nt(w_ref[...], St, prec)
    o = mm_nt(qi_ref[...], St, prec) + mm(a_ref[...], v_new, prec)
    o_ref[...] = o.astype(o_ref.dtype)

  return pl.pallas_call(
      kernel,
      grid=(BH, N, V // BV),
      in_specs=[k_side, v_side, k_side, a_spec, state],
      out_specs=v_side,
      out_shape=jax.ShapeDtypeStruct((BH, N, C, V), out_dtype),
      compiler_params=_parallel_params(cfg),
      interpret=interpret,
      name="kda_output_gpu",
  )(w, u, q_in, a_qk, st)


def recurrent_forward(w, u, q_in, k_out, a_qk, decay, s0t, *, out_dtype, cfg: GpuConfig,
                      interpret: bool):
  """Split forward's recurrence: (o [BH, N, C, V] in out_dtype, final St [BH, V, K] f32).

  Two kernels: the sequential states pass (BH x V / BV programs) and the chunk-parallel
  output pass (BH x N x V / BV programs), so the chunk-parallel work fills the SMs."""
  st, final = _states_and_final(w, u, k_out, decay, s0t, cfg=cfg, interpret=interpret)
  o = _outputs(w, u, q_in, a_qk, st, out_dtype=out_dtype, cfg=cfg, interpret=interpret)
  return o, final


def _state_grads(w, q_in, k_out, a_qk, do, decay, dht_t, *, cfg: GpuConfig, interpret: bool):
  """The reverse pass: the gradient w.r.t. the state leaving each chunk, dSt [BH, N, V, K]
  f32, and w.r.t. the initial state [BH, V, K]. It needs no forward state:
  dS_in = q_in^T do + decay dS - W^T dVn with dVn = A^T do + k_out dS. The carry is
  dS [K, 8] (STATE_BV); the gradients are stored transposed."""
  BH, N, _, K = w.shape
  prec = lax_precision(cfg.precision)

  def body(n, dS, w_ref, qi_ref, ko_ref, a_ref, do_ref, d_ref):
    do = do_ref[n].astype(_f32)
    dv_new = mm_tn(a_ref[n], do, prec) + mm(ko_ref[n], dS, prec)
    return mm_tn(qi_ref[n], do, prec) + dS * d_ref[n] - mm_tn(w_ref[n], dv_new, prec)

  return _sequential_pass(body, (w, q_in, k_out, a_qk, do, decay.reshape(BH, N, K, 1)),
                          "kkkavd", dht_t, reverse=True, name="kda_dstates_gpu", cfg=cfg,
                          interpret=interpret)


def backward(w, q_in, k_out, a_qk, u, do, decay, st, dht_t, *, cfg: GpuConfig,
             interpret: bool):
  """Reverse chunk recurrence. Returns (dw, dq_in, dk_out [1, BH, N, C, K],
  da [G, BH, N, C, C], du [BH, N, C, V], ddecay [G, BH, N, 1, K], dS0t [BH, V, K]) (the
  leading axes: partial sums over groups of value tiles, summed by the caller; G = 2 when
  there are two or more value tiles, so the score kernel has 2 x BH x N programs).

  The sequential reverse pass over the state gradient (`_state_grads`), then every chunk's
  gradients at once from the states entering it (st) and the state gradients leaving it
  (the chunk recurrence's reverse products, without its carry), in two kernels of one program
  per (head, chunk): dw, dq_in, dk_out; and da, du, ddecay. Each walks the value tiles of
  BV and sums over them in registers, so no per-tile partial sums reach HBM."""
  BH, N, C, K = w.shape
  V, BV = u.shape[-1], cfg.block_v
  NV = V // BV
  NG = 2 if NV % 2 == 0 else 1   # value-tile groups of the score kernel
  prec = lax_precision(cfg.precision)
  dst, ds0 = _state_grads(w, q_in, k_out, a_qk, do, decay, dht_t, cfg=cfg,
                          interpret=interpret)

  def per_chunk(rows, cols):  # [rows, cols] of chunk n of head i, whatever the third axis
    return pl.BlockSpec((None, None, rows, cols), lambda i, n, h: (i, n, 0, 0))

  k_side, v_all, states_spec = per_chunk(C, K), per_chunk(C, V), per_chunk(V, K)
  ins = (w, k_out, a_qk, u, do, st, dst)
  in_specs = [k_side, k_side, per_chunk(C, C), v_all, v_all, states_spec, states_spec]

  def walk(refs, step, init, first=0, count=NV):
    """fori_loop over value tiles first .. first + count - 1 (not unrolled: only the
    accumulators stay live across tiles; W, k_out and A are read again per tile).
    step(St, dSt, do, v_new, dv_new, cols, acc) -> acc."""
    w_ref, ko_ref, a_ref, u_ref, do_ref, st_ref, dst_ref = refs

    def tile(j, acc):
      cols = pl.ds(pl.multiple_of(j * BV, BV), BV)
      St, dSt = st_ref[cols, :], dst_ref[cols, :]
      do = do_ref[:, cols].astype(_f32)
      v_new = u_ref[:, cols] - mm_nt(w_ref[...], St, prec)
      dv_new = mm_tn(a_ref[...], do, prec) + mm_nt(ko_ref[...], dSt, prec)
      return step(St, dSt, do, v_new, dv_new, cols, acc)

    return lax.fori_loop(first, first + count, tile, init)

  # Two kernels, so that no program keeps more than three fp32 accumulators of [C, 32]
  # (ptxas at K = 128: all five of [C, K] in one program spilled 6.6 KB; three of [C, 64],
  # 4 bytes): dw, dq_in, dk_out per (head, chunk, 32 columns of K); da, du, ddecay per
  # (head, chunk).
  KH = min(K, 32)
  NK = K // KH

  def k_side_kernel(*refs):
    st_ref, dst_ref = refs[5], refs[6]
    dw_ref, dqi_ref, dko_ref = refs[7:]
    half = pl.ds(pl.multiple_of(pl.program_id(2) * KH, KH), KH)   # this program's columns

    def step(St, dSt, do, v_new, dv_new, cols, acc):
      dw, dqi, dko = acc
      St_h, dSt_h = st_ref[cols, half], dst_ref[cols, half]
      return (dw - mm(dv_new, St_h, prec), dqi + mm(do, St_h, prec),
              dko + mm(v_new, dSt_h, prec))

    zk = jnp.zeros((C, KH), _f32)
    dw_ref[...], dqi_ref[...], dko_ref[...] = walk(refs[:7], step, (zk, zk, zk))

  def score_kernel(*refs):
    da_ref, du_ref, dd_ref = refs[7:]

    def step(St, dSt, do, v_new, dv_new, cols, acc):
      du_ref[:, cols] = dv_new
      da, dd = acc
      return da + mm_nt(do, v_new, prec), dd + jnp.sum(St * dSt, axis=0, keepdims=True)

    per = NV // NG   # this program's group of value tiles (du: its columns only)
    da_ref[...], dd_ref[...] = walk(refs[:7], step, (jnp.zeros((C, C), _f32),
                                                     jnp.zeros((1, K), _f32)),
                                    first=pl.program_id(2) * per, count=per)

  half_out = pl.BlockSpec((None, None, None, C, KH), lambda i, n, h: (0, i, n, 0, h))
  dw, dq_in, dk_out = pl.pallas_call(
      k_side_kernel,
      grid=(BH, N, NK),
      in_specs=in_specs,
      out_specs=[half_out] * 3,
      out_shape=[jax.ShapeDtypeStruct((1, BH, N, C, K), _f32)] * 3,
      compiler_params=_parallel_params(cfg),
      interpret=interpret,
      name="kda_bwd_gpu",
  )(*ins)
  da, du, ddecay = pl.pallas_call(
      score_kernel,
      grid=(BH, N, NG),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, None, C, C), lambda i, n, h: (h, i, n, 0, 0)),
                 v_all,
                 pl.BlockSpec((None, None, None, 1, K), lambda i, n, h: (h, i, n, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((NG, BH, N, C, C), _f32),
                 jax.ShapeDtypeStruct((BH, N, C, V), _f32),
                 jax.ShapeDtypeStruct((NG, BH, N, 1, K), _f32)],
      compiler_params=_parallel_params(cfg),
      interpret=interpret,
      name="kda_bwd_scores_gpu",
  )(*ins)
  return dw, dq_in, dk_out, da, du, ddecay, ds0


# Chunks per slice of the split path. The chunk-parallel XLA glue (chunk_prep, its vjp) and
# the per-chunk states live one slice at a time: a loop over slices carries the state, so
# the temporaries are one slice's, whatever T. Compiled for an H100 at B1 T8K H16 K=V=128
# bf16, fwd+bwd temporaries: the whole sequence at once 1,843 MiB; slices of 16 chunks
# 303 MiB; of 8 chunks (512 tokens) 164 MiB, the TPU kernel's 111 MiB x 1.5. Eight chunks
# still give every launch >= 2 x B x HV x 8 programs (256 at B1 H16).
SLICE_CHUNKS = 8


def slice_plan(n_chunks: int) -> tuple[int, int]:
  """(slices, chunks per slice) covering n_chunks with the fewest padded chunks."""
  slices = -(-n_chunks // SLICE_CHUNKS)
  return slices, -(-n_chunks // slices)


def _padded_slicer(T: int, C: int):
  """(slices, slice length L, pad, take, put) for arrays [B, T, ...] along axis 1.

  pad: x -> x zero-padded to slices * L tokens, folded to [B, slices, L * ...] (rows of one
  slice contiguous, a layout no transposition applies to: sliced unfolded, XLA:GPU gave
  the loops transposed whole-sequence copies of q, k, v and of their gradients);
  take(x, s) -> slice s unfolded, [B, L, ...]; put(acc, s, y) writes y [B, L, ...] as slice s
  of a folded buffer; unfold(x) -> [B, T, ...]."""
  slices, per = slice_plan(-(-T // C))
  L = per * C

  def pad(x):
    extra = slices * L - x.shape[1]
    if extra:
      x = jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(x.shape[0], slices, -1)

  def take(x, s, tail):
    return lax.dynamic_index_in_dim(x, s, axis=1, keepdims=False).reshape(
        x.shape[0], L, *tail)

  def put(acc, s, y):
    return lax.dynamic_update_index_in_dim(acc, y.reshape(acc.shape[0], -1).astype(acc.dtype),
                                           s, axis=1)

  def unfold(x, tail):
    return x.reshape(x.shape[0], slices * L, *tail)[:, :T]

  return slices, L, pad, take, put, unfold


def _value_chunks(x, C):
  """[B, L, HV, V] -> [B*HV, L / C, C, V] in x's dtype (the kernels cast)."""
  B, L, HV, V = x.shape
  return jnp.swapaxes(x, 1, 2).reshape(B * HV, L // C, C, V)


def sliced_forward(q, k, v, g, beta, seg, s0t, *, prep_fn, cfg: GpuConfig, interpret: bool):
  """The split forward one slice of SLICE_CHUNKS chunks at a time.

  Args: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; seg None or
    [B, T] float32 chunk-local segments (T a multiple of the chunk); s0t [B*HV, V, K] f32
    (the transposed initial state); prep_fn(q, k, v, g, beta, seg) -> ChunkPrep of those
    tokens (layout [B*HV, N, C, F]).
  Returns: (o [B, T, HV, V] in v's dtype, the final state transposed [B*HV, V, K] f32).
  Padding tokens (zeros) are no-ops, so the state passes them unchanged."""
  B, T = q.shape[:2]
  HV, V = v.shape[2], v.shape[3]
  slices, L, pad, take, put, unfold = _padded_slicer(T, cfg.chunk_size)
  ins = (q, k, v, g, beta)
  xs = [pad(x) for x in ins]
  segp = None if seg is None else pad(seg)

  def body(s, carry):
    o_all, St = carry
    prep = prep_fn(*(take(x, s, a.shape[2:]) for x, a in zip(xs, ins)),
                   None if segp is None else take(segp, s, ()))
    o, St = recurrent_forward(prep.w, prep.u, prep.q_in, prep.k_out, prep.a_qk, prep.decay,
                              St, out_dtype=v.dtype, cfg=cfg, interpret=interpret)
    return put(o_all, s, jnp.swapaxes(o.reshape(B, HV, L, V), 1, 2)), St

  o, St = lax.fori_loop(0, slices, body,
                        (jnp.zeros((B, slices, L * HV * V), v.dtype), s0t.astype(_f32)))
  return unfold(o, (HV, V)), St


def sliced_backward(q, k, v, g, beta, seg, s0t, do, dht_t, *, prep_fn, cfg: GpuConfig,
                    interpret: bool):
  """The split path's backward one slice at a time (arguments as sliced_forward's, with
  do [B, T, HV, V] and dht_t [B*HV, V, K] f32, the transposed final-state gradient).

  Two loops: forward over slices, keeping only the state entering each slice
  ([slices, B*HV, V, K] f32); then backward over slices: chunk_prep and its vjp, the states
  entering the slice's chunks (states pass from the saved slice state), the reverse pass and
  the gradient kernels (`backward`), the slice's input gradients written into whole-sequence
  buffers. Returns ((dq, dk, dv, dg, dbeta) shaped and typed as the inputs, dS0t [B*HV, V, K]
  f32)."""
  T, C = q.shape[1], cfg.chunk_size
  slices, L, pad, take, put, unfold = _padded_slicer(T, C)
  ins = (q, k, v, g, beta)
  xs = [pad(x) for x in ins]
  segp = None if seg is None else pad(seg)
  dop = pad(do)

  def inputs_of(s):
    return [take(x, s, a.shape[2:]) for x, a in zip(xs, ins)]

  def seg_of(s):
    return None if segp is None else take(segp, s, ())

  def forward(s, carry):
    St, entering = carry
    entering = lax.dynamic_update_index_in_dim(entering, St, s, axis=0)
    prep = prep_fn(*inputs_of(s), seg_of(s))
    _, St = _states_and_final(prep.w, prep.u, prep.k_out, prep.decay, St, cfg=cfg,
                              interpret=interpret)
    return St, entering

  s0t = s0t.astype(_f32)
  _, entering = lax.fori_loop(0, slices, forward,
                              (s0t, jnp.zeros((slices, *s0t.shape), _f32)))

  def reverse(i, carry):
    s = slices - 1 - i
    dSt, grads = carry
    prep, prep_vjp = jax.vjp(lambda *a: prep_fn(*a, seg_of(s)), *inputs_of(s))
    st, _ = _states_and_final(prep.w, prep.u, prep.k_out, prep.decay,
                              lax.dynamic_index_in_dim(entering, s, axis=0, keepdims=False),
                              cfg=cfg, interpret=interpret)
    dw, dq_in, dk_out, da, du, ddecay, dSt = backward(
        prep.w, prep.q_in, prep.k_out, prep.a_qk, prep.u,
        _value_chunks(take(dop, s, do.shape[2:]), C), prep.decay, st, dSt, cfg=cfg,
        interpret=interpret)
    d = prep_vjp(type(prep)(w=dw.sum(0), u=du, q_in=dq_in.sum(0), k_out=dk_out.sum(0),
                            a_qk=da.sum(0), decay=ddecay.sum(0)))
    return dSt, [put(acc, s, dx) for acc, dx in zip(grads, d)]

  dS0t, grads = lax.fori_loop(0, slices, reverse,
                              (dht_t.astype(_f32), [jnp.zeros_like(x) for x in xs]))
  return tuple(unfold(d, a.shape[2:]) for d, a in zip(grads, ins)), dS0t
