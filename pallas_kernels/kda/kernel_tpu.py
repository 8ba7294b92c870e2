"""KDA kernels for TPU (Mosaic): grid (batch, value head, chunk) with the chunk axis
sequential ("arbitrary") and the fp32 state St = S^T [V, K] in a VMEM scratch buffer.

Each grid step sees one chunk's blocks ([C, F], F = K or V: the last two block dims equal
the array dims or are (C, 128)-tileable) and runs chunk_math on them; the whole V is handled
by one program. Layouts as in kernel_gpu.py. The backward's K-side gradients come back with a
leading value-tile axis of size 1 so the caller treats both backends alike.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .chunk_math import SUB, chunk_apply, forward_chunk, output_chunk, states_chunk
from .config import TpuConfig, lax_precision

_f32 = jnp.float32
# The backward's f32 head scratch (~5 MiB at hb = 8, stride 2, C = 64, K = V = 128), its
# double-buffered blocks and the vjp's spills exceed the default scoped VMEM (16 MiB).
# Every TPU from v4 on has >= 32 MiB of VMEM per core.
_BWD_VMEM_MIB = 32


@dataclasses.dataclass(frozen=True)
class Layout:
  """Shapes of the TPU kernels' operands. Token arrays keep the caller's [B, Tp, heads, F]
  layout (TPU tiles their last two dims (heads, F), so any other layout would be a copy in
  XLA): a grid step reads `hb` value heads x `stride * C` tokens and walks its heads with a
  static loop (a dynamic head index into packed bf16 tiles does not compile). tp: T padded
  to whole groups of `stride` chunks (stride: chunks per state saved for the backward)."""

  B: int
  tp: int
  H: int
  HV: int
  K: int
  V: int
  stride: int

  @property
  def hb(self) -> int:
    """Value heads per grid step: 8 (a sublane tile) when they split evenly and q/k heads
    are not grouped; else all (the block then equals the array dim, as Mosaic requires)."""
    return 8 if self.HV % 8 == 0 and self.HV == self.H else self.HV


def _params(n_parallel: int, vmem_mib: int | None = None):
  return pltpu.CompilerParams(
      dimension_semantics=("parallel",) * n_parallel + ("arbitrary",),
      vmem_limit_bytes=None if vmem_mib is None else vmem_mib << 20)


def _tok(rows: int, heads: int, f: int, blk):
  """BlockSpec of a token array [B, Tp, *, f]: `heads` heads x `rows` tokens per step."""
  return pl.BlockSpec((None, rows, heads, f), lambda b, h, n: (b, blk(n), h, 0))


def _select_head(x, h):
  """Column h of a [rows, HV] value as [rows, 1] (beta of value head h; a masked lane sum,
  exact: one nonzero term)."""
  lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.sum(jnp.where(lane == h, x, 0.0), axis=1, keepdims=True)


def forward(q, k, v, g, beta, h0t, seg=None, *, lay: Layout, cfg: TpuConfig, scale: float,
            lower_bound: float, interpret: bool, save_states: bool = False,
            cost: pl.CostEstimate | None = None):
  """Fused forward over the chunks of each (batch, value head).

  Args: q, k [B, Tp, H, K]; v [B, Tp, HV, V]; g [B, Tp, HV, K] (any float dtypes, upcast
    in-kernel); beta [B, Tp, HV]; h0t [B, HV, V, K] f32 (S^T); seg optional [B, Tp, 1] f32
    chunk-local segment index (packed sequences).
  Returns: (o [B, Tp, HV, V] in v's dtype, final St [B, HV, V, K] f32) and, if
    save_states, the states entering every group of lay.stride chunks
    [B, HV, N / stride, V, K] f32 (the backward's only residual besides the inputs).
  """
  B, Tp, H, HV, K, V, hb = lay.B, lay.tp, lay.H, lay.HV, lay.K, lay.V, lay.hb
  rep, C, m = HV // H, cfg.chunk_size, lay.stride
  N = Tp // C
  prec = lax_precision(cfg.precision)
  packed = seg is not None

  def kernel(*refs):
    q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref = refs[:6]
    seg_ref = refs[6] if packed else None
    outs = refs[6 + packed:-1]
    o_ref, ht_ref = outs[:2]
    st_scr = refs[-1]
    n, hblk = pl.program_id(2), pl.program_id(1)

    @pl.when(n == 0)
    def _():
      st_scr[...] = h0_ref[...]

    if save_states:
      @pl.when(n % m == 0)
      def _():
        outs[2][...] = st_scr[...]

    for hh in range(hb):  # static: see Layout
      src = dict(q=(q_ref, hh // rep), k=(k_ref, hh // rep), v=(v_ref, hh), g=(g_ref, hh))

      def load(name, r, hh=hh, src=src):
        rows = pl.ds(SUB * r, SUB)
        if name == "beta":
          return _select_head(b_ref[rows, :].astype(_f32), hblk * hb + hh)
        if name == "seg":
          return seg_ref[rows, :]
        ref, head = src[name]
        return ref[rows, head, :].astype(_f32)

      def store(r, o, hh=hh):
        o_ref[pl.ds(SUB * r, SUB), hh, :] = o.astype(o_ref.dtype)

      St = forward_chunk(load, store, st_scr[hh], nb=C // SUB, lower_bound=lower_bound,
                         scale=scale, prec=prec, packed=packed)
      st_scr[hh] = St

    @pl.when(n == N - 1)
    def _():
      ht_ref[...] = st_scr[...]

  step = lambda n: n  # noqa: E731
  state_spec = pl.BlockSpec((None, hb, V, K), lambda b, h, n: (b, h, 0, 0))
  in_specs = [_tok(C, hb // rep, K, step), _tok(C, hb // rep, K, step),
              _tok(C, hb, V, step), _tok(C, hb, K, step),
              pl.BlockSpec((None, C, HV), lambda b, h, n: (b, n, 0)), state_spec]
  extra = ()
  if packed:  # one segment index per token, shared by all heads
    in_specs.append(pl.BlockSpec((None, C, 1), lambda b, h, n: (b, n, 0)))
    extra = (seg,)
  out_specs = [_tok(C, hb, V, step), state_spec]
  out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct((B, HV, V, K), _f32)]
  if save_states:
    out_specs.append(pl.BlockSpec((None, hb, None, V, K),
                                  lambda b, h, n: (b, h, n // m, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((B, HV, N // m, V, K), _f32))
  return pl.pallas_call(
      kernel,
      grid=(B, HV // hb, N),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((hb, V, K), _f32)],
      compiler_params=_params(2),
      interpret=interpret,
      cost_estimate=cost,
      name="kda_fwd_packed_tpu" if packed else "kda_fwd_tpu",
  )(q, k, v, g, beta, h0t, *extra)


def backward(q, k, v, g, beta, seg, do, states, dht_t, *, lay: Layout, cfg: TpuConfig,
             scale: float, lower_bound: float, interpret: bool,
             cost: pl.CostEstimate | None = None):
  """The whole backward in one kernel: the grid walks the groups of lay.stride chunks last
  to first with dS (the gradient w.r.t. the state leaving the group) in VMEM scratch. Per
  group and head: the states entering its chunks are recomputed forward from the saved
  state (states [B, HV, N / stride, V, K], from forward(save_states=True)), then each chunk,
  last first, is differentiated in-kernel: jax.vjp of chunk_math.chunk_apply, the forward
  kernel's own math, with cotangents (do rows, dS). Nothing per chunk goes to HBM except the
  input gradients.

  Args: q..seg as forward, do [B, Tp, HV, V] in v's dtype, dht_t [B, HV, V, K] f32.
  Returns: dq, dk [B, Tp, HV, K] per value head (float32 when heads are grouped, for the
    caller's sum over the group, else q's dtype), dv, dg (v's / g's shape and dtype),
    dbeta [B, HV / hb, Tp, hb] f32, dS0t [B, HV, V, K] f32.
  """
  B, Tp, H, HV, K, V, hb = lay.B, lay.tp, lay.H, lay.HV, lay.K, lay.V, lay.hb
  rep, C, m = HV // H, cfg.chunk_size, lay.stride
  NG, nb, R = Tp // (C * m), C // SUB, C * m
  prec = lax_precision(cfg.precision)
  packed = seg is not None
  chunk = functools.partial(chunk_apply, nb=nb, lower_bound=lower_bound, scale=scale,
                            prec=prec)

  def kernel(*refs):
    q_ref, k_ref, v_ref, g_ref, b_ref = refs[:5]
    seg_ref = refs[5] if packed else None
    do_ref, st_ref, dht_ref = refs[5 + packed:8 + packed]
    dq_ref, dk_ref, dv_ref, dg_ref, db_ref, ds0_ref = refs[8 + packed:14 + packed]
    ds_scr, xq, xk, xv, xg, xdo, gq, gk, gv, gg, gb = refs[14 + packed:]
    s, hblk = pl.program_id(2), pl.program_id(1)

    @pl.when(s == 0)
    def _():
      ds_scr[...] = dht_ref[...]

    # Heads to f32 scratch [heads, R, F] with static (strided) loads, so that the heavy
    # per-head body below is one loop body indexed on the leading dim (a dynamic head index
    # into the packed bf16 blocks does not compile; unrolling 8 heads overflows VMEM).
    for hh in range(hb // rep):
      xq[hh] = q_ref[:, hh, :].astype(_f32)
      xk[hh] = k_ref[:, hh, :].astype(_f32)
    for hh in range(hb):
      xv[hh] = v_ref[:, hh, :].astype(_f32)
      xg[hh] = g_ref[:, hh, :].astype(_f32)
      xdo[hh] = do_ref[:, hh, :].astype(_f32)
    gb[...] = jnp.zeros_like(gb)

    def rows(j, r):
      return pl.ds(j * C + SUB * r, SUB)

    def inputs(j, hh):
      x = {name: [ref[hd, rows(j, r), :] for r in range(nb)]
           for name, ref, hd in (("q", xq, hh // rep), ("k", xk, hh // rep), ("v", xv, hh),
                                 ("g", xg, hh))}
      x["beta"] = [_select_head(b_ref[rows(j, r), :].astype(_f32), hblk * hb + hh)
                   for r in range(nb)]
      sg = None if seg_ref is None else [seg_ref[rows(j, r), :] for r in range(nb)]
      return x, sg

    lane = jax.lax.broadcasted_iota(jnp.int32, (SUB, hb), 1)

    def head(hh, carry):
      S = [st_ref[hh]]  # states entering the group's chunks, recomputed
      for j in range(m - 1):
        x, sg = inputs(j, hh)
        S.append(chunk(x, S[j], sg)[1])
      dS = ds_scr[hh]
      for j in reversed(range(m)):
        x, sg = inputs(j, hh)
        _, vjp = jax.vjp(lambda x_, St_, sg=sg: chunk(x_, St_, sg), x, S[j])
        do = [xdo[hh, rows(j, r), :] for r in range(nb)]
        dx, dS = vjp((do, dS))
        for name, ref in (("v", gv), ("g", gg), ("q", gq), ("k", gk)):
          for r in range(nb):
            ref[hh, rows(j, r), :] = dx[name][r]
        for r in range(nb):  # dbeta of head hh into lane hh of the [16, hb] block
          gb[rows(j, r), :] = jnp.where(lane == hh, dx["beta"][r], gb[rows(j, r), :])
      ds_scr[hh] = dS
      return carry

    jax.lax.fori_loop(0, hb, head, 0)
    for hh in range(hb):
      dq_ref[:, hh, :] = gq[hh].astype(dq_ref.dtype)
      dk_ref[:, hh, :] = gk[hh].astype(dk_ref.dtype)
      dv_ref[:, hh, :] = gv[hh].astype(dv_ref.dtype)
      dg_ref[:, hh, :] = gg[hh].astype(dg_ref.dtype)
    db_ref[...] = gb[...]

    @pl.when(s == NG - 1)
    def _():
      ds0_ref[...] = ds_scr[...]

  rev = lambda n: NG - 1 - n  # noqa: E731
  state_spec = pl.BlockSpec((None, hb, V, K), lambda b, h, n: (b, h, 0, 0))
  in_specs = [_tok(R, hb // rep, K, rev), _tok(R, hb // rep, K, rev), _tok(R, hb, V, rev),
              _tok(R, hb, K, rev), pl.BlockSpec((None, R, HV), lambda b, h, n: (b, rev(n), 0))]
  extra = ()
  if packed:
    in_specs.append(pl.BlockSpec((None, R, 1), lambda b, h, n: (b, rev(n), 0)))
    extra = (seg,)
  in_specs += [_tok(R, hb, V, rev),
               pl.BlockSpec((None, hb, None, V, K), lambda b, h, n: (b, h, rev(n), 0, 0)),
               state_spec]
  dqk = jax.ShapeDtypeStruct((B, Tp, HV, K), _f32 if rep > 1 else q.dtype)
  out_shape = [dqk, dqk, jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct(g.shape, g.dtype),
               jax.ShapeDtypeStruct((B, HV // hb, Tp, hb), _f32),
               jax.ShapeDtypeStruct((B, HV, V, K), _f32)]
  out_specs = [_tok(R, hb, K, rev), _tok(R, hb, K, rev), _tok(R, hb, V, rev),
               _tok(R, hb, K, rev),
               pl.BlockSpec((None, None, R, hb), lambda b, h, n: (b, h, rev(n), 0)),
               state_spec]
  return pl.pallas_call(
      kernel,
      grid=(B, HV // hb, NG),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((hb, V, K), _f32)]
      + [pltpu.VMEM((hb // rep, R, K), _f32)] * 2  # q, k
      + [pltpu.VMEM((hb, R, f), _f32) for f in (V, K, V)]  # v, g, do
      + [pltpu.VMEM((hb, R, f), _f32) for f in (K, K, V, K)]  # dq, dk, dv, dg
      + [pltpu.VMEM((R, hb), _f32)],  # dbeta
      compiler_params=_params(2, _BWD_VMEM_MIB),
      interpret=interpret,
      cost_estimate=cost,
      name="kda_bwd_packed_tpu" if packed else "kda_bwd_tpu",
  )(q, k, v, g, beta, *extra, do, states, dht_t)


def _chunk(rows: int, f: int):
  """BlockSpec of the split path's chunk layout [BH, N, rows, f], grid (BH, N): chunk n of
  head i."""
  return pl.BlockSpec((None, None, rows, f), lambda i, n: (i, n, 0, 0))


def states(w, u, k_out, decay, s0t, *, cfg: TpuConfig, interpret: bool):
  """States entering each chunk: St [BH, N, V, K] f32 from chunk_prep's w, u, k_out, decay."""
  BH, N, C, K = w.shape
  V = u.shape[-1]
  prec = lax_precision(cfg.precision)

  def kernel(w_ref, u_ref, ko_ref, d_ref, s0_ref, st_ref, st_scr):
    @pl.when(pl.program_id(1) == 0)
    def _():
      st_scr[...] = s0_ref[...]

    St = st_scr[...]
    st_ref[...] = St
    st_scr[...] = states_chunk(w_ref[...], u_ref[...], ko_ref[...], d_ref[...], St, prec)

  return pl.pallas_call(
      kernel,
      grid=(BH, N),
      in_specs=[_chunk(C, K), _chunk(C, V), _chunk(C, K), _chunk(1, K),
                pl.BlockSpec((None, V, K), lambda i, n: (i, 0, 0))],
      out_specs=_chunk(V, K),
      out_shape=jax.ShapeDtypeStruct((BH, N, V, K), _f32),
      scratch_shapes=[pltpu.VMEM((V, K), _f32)],
      compiler_params=_params(1),
      interpret=interpret,
      name="kda_states_tpu",
  )(w, u, k_out, decay, s0t)


def recurrent_forward(w, u, q_in, k_out, a_qk, decay, s0t, *, out_dtype, cfg: TpuConfig,
                      interpret: bool):
  """Split forward's recurrence: (o [BH, N, C, V] in out_dtype, final St [BH, V, K] f32)."""
  BH, N, C, K = w.shape
  V = u.shape[-1]
  prec = lax_precision(cfg.precision)

  def kernel(w_ref, u_ref, qi_ref, ko_ref, a_ref, d_ref, s0_ref, o_ref, ht_ref, st_scr):
    n = pl.program_id(1)

    @pl.when(n == 0)
    def _():
      st_scr[...] = s0_ref[...]

    o, St = output_chunk(w_ref[...], u_ref[...], qi_ref[...], ko_ref[...], a_ref[...],
                         d_ref[...], st_scr[...], prec)
    o_ref[...] = o.astype(o_ref.dtype)
    st_scr[...] = St

    @pl.when(n == N - 1)
    def _():
      ht_ref[...] = St

  state = pl.BlockSpec((None, V, K), lambda i, n: (i, 0, 0))
  return pl.pallas_call(
      kernel,
      grid=(BH, N),
      in_specs=[_chunk(C, K), _chunk(C, V), _chunk(C, K), _chunk(C, K), _chunk(C, C),
                _chunk(1, K), state],
      out_specs=[_chunk(C, V), state],
      out_shape=[jax.ShapeDtypeStruct((BH, N, C, V), out_dtype),
                 jax.ShapeDtypeStruct((BH, V, K), _f32)],
      scratch_shapes=[pltpu.VMEM((V, K), _f32)],
      compiler_params=_params(1),
      interpret=interpret,
      name="kda_recurrent_fwd_tpu",
  )(w, u, q_in, k_out, a_qk, decay, s0t)
