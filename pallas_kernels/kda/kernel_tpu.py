"""KDA kernels for TPU (Mosaic): grid (batch, value head, chunk) with the chunk axis
sequential ("arbitrary") and the fp32 state St = S^T [V, K] in a VMEM scratch buffer.

Each grid step sees one chunk's blocks ([C, F], F = K or V: the last two block dims equal
the array dims or are (C, 128)-tileable) and runs chunk_math on them; the whole V is handled
by one program. Layouts as in kernel_gpu.py. The backward's K-side gradients come back with a
leading value-tile axis of size 1 so the caller treats both backends alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .chunk_math import SUB, backward_chunk, forward_chunk, output_chunk, states_chunk
from .config import TpuConfig, lax_precision

_f32 = jnp.float32


def _params(n_parallel: int):
  return pltpu.CompilerParams(
      dimension_semantics=("parallel",) * n_parallel + ("arbitrary",))


def forward(q, k, v, g, beta, h0t, seg=None, *, cfg: TpuConfig, scale: float,
            lower_bound: float, interpret: bool):
  """Fused forward. Returns (o [B, HV, Tp, V] in v's dtype, final St [B, HV, V, K] f32).

  seg: optional [B, Tp, 1] float32 chunk-local segment index (packed sequences)."""
  B, H, Tp, K = q.shape
  HV, V = v.shape[1], v.shape[3]
  rep, C = HV // H, cfg.chunk_size
  N = Tp // C
  prec = lax_precision(cfg.precision)
  packed = seg is not None

  def kernel(*refs):
    if packed:
      q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, seg_ref, o_ref, ht_ref, st_scr = refs
    else:
      q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, ht_ref, st_scr = refs
      seg_ref = None
    n = pl.program_id(2)
    refs = dict(q=q_ref, k=k_ref, v=v_ref, g=g_ref, beta=b_ref, seg=seg_ref)

    @pl.when(n == 0)
    def _():
      st_scr[...] = h0_ref[...]

    def load(name, r):
      return refs[name][pl.ds(SUB * r, SUB), :].astype(_f32)

    def store(r, o):
      o_ref[pl.ds(SUB * r, SUB), :] = o.astype(o_ref.dtype)

    St = forward_chunk(load, store, st_scr[...], nb=C // SUB, lower_bound=lower_bound,
                       scale=scale, prec=prec, packed=packed)
    st_scr[...] = St

    @pl.when(n == N - 1)
    def _():
      ht_ref[...] = St

  def chunk(f, heads=lambda h: h):
    return pl.BlockSpec((None, None, C, f), lambda b, h, n: (b, heads(h), n, 0))

  state_spec = pl.BlockSpec((None, None, V, K), lambda b, h, n: (b, h, 0, 0))
  in_specs = [chunk(K, lambda h: h // rep), chunk(K, lambda h: h // rep), chunk(V),
              chunk(K), chunk(1), state_spec]
  extra = ()
  if packed:  # one segment index per token, shared by all heads
    in_specs.append(pl.BlockSpec((None, C, 1), lambda b, h, n: (b, n, 0)))
    extra = (seg,)
  return pl.pallas_call(
      kernel,
      grid=(B, HV, N),
      in_specs=in_specs,
      out_specs=[chunk(V), state_spec],
      out_shape=[jax.ShapeDtypeStruct((B, HV, Tp, V), v.dtype),
                 jax.ShapeDtypeStruct((B, HV, V, K), _f32)],
      scratch_shapes=[pltpu.VMEM((V, K), _f32)],
      compiler_params=_params(2),
      interpret=interpret,
      name="kda_fwd_packed_tpu" if packed else "kda_fwd_tpu",
  )(q, k, v, g, beta, h0t, *extra)


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

  def chunk(f):
    return pl.BlockSpec((None, None, C, f), lambda i, n: (i, n, 0, 0))

  return pl.pallas_call(
      kernel,
      grid=(BH, N),
      in_specs=[chunk(K), chunk(V), chunk(K),
                pl.BlockSpec((None, None, 1, K), lambda i, n: (i, n, 0, 0)),
                pl.BlockSpec((None, V, K), lambda i, n: (i, 0, 0))],
      out_specs=pl.BlockSpec((None, None, V, K), lambda i, n: (i, n, 0, 0)),
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

  def chunk(rows, f):
    return pl.BlockSpec((None, None, rows, f), lambda i, n: (i, n, 0, 0))

  state = pl.BlockSpec((None, V, K), lambda i, n: (i, 0, 0))
  return pl.pallas_call(
      kernel,
      grid=(BH, N),
      in_specs=[chunk(C, K), chunk(C, V), chunk(C, K), chunk(C, K), chunk(C, C),
                chunk(1, K), state],
      out_specs=[chunk(C, V), state],
      out_shape=[jax.ShapeDtypeStruct((BH, N, C, V), out_dtype),
                 jax.ShapeDtypeStruct((BH, V, K), _f32)],
      scratch_shapes=[pltpu.VMEM((V, K), _f32)],
      compiler_params=_params(1),
      interpret=interpret,
      name="kda_recurrent_fwd_tpu",
  )(w, u, q_in, k_out, a_qk, decay, s0t)


def backward(w, q_in, k_out, a_qk, u, do, decay, st, dht_t, *, cfg: TpuConfig,
             interpret: bool):
  """Reverse chunk recurrence (grid walks the chunks last to first). Returns (dw, dq_in,
  dk_out [1, BH, N, C, K], da [1, BH, N, C, C], du [BH, N, C, V],
  ddecay [1, BH, N, 1, K], dS0t [BH, V, K])."""
  BH, N, C, K = w.shape
  V = u.shape[-1]
  prec = lax_precision(cfg.precision)

  def kernel(w_ref, qi_ref, ko_ref, a_ref, u_ref, do_ref, d_ref, st_ref, dht_ref,
             dw_ref, dqi_ref, dko_ref, da_ref, du_ref, dd_ref, ds0_ref, ds_scr):
    step = pl.program_id(1)

    @pl.when(step == 0)
    def _():
      ds_scr[...] = dht_ref[...]

    outs = backward_chunk(w_ref[...], qi_ref[...], ko_ref[...], a_ref[...], u_ref[...],
                          do_ref[...].astype(_f32), d_ref[...], st_ref[...],
                          ds_scr[...], prec)
    for ref, x in zip((dw_ref, dqi_ref, dko_ref, da_ref, du_ref, dd_ref), outs[:6]):
      ref[...] = x
    ds_scr[...] = outs[6]

    @pl.when(step == N - 1)
    def _():
      ds0_ref[...] = outs[6]

  def rev(rows, f, lead=()):
    none = (None,) * (len(lead) + 2)
    return pl.BlockSpec((*none, rows, f), lambda i, s: (*lead, i, N - 1 - s, 0, 0))

  state = pl.BlockSpec((None, V, K), lambda i, s: (i, 0, 0))
  out_shape = [jax.ShapeDtypeStruct((1, BH, N, C, f), _f32) for f in (K, K, K, C)]
  out_shape += [jax.ShapeDtypeStruct((BH, N, C, V), _f32),
                jax.ShapeDtypeStruct((1, BH, N, 1, K), _f32),
                jax.ShapeDtypeStruct((BH, V, K), _f32)]
  return pl.pallas_call(
      kernel,
      grid=(BH, N),
      in_specs=[rev(C, K), rev(C, K), rev(C, K), rev(C, C), rev(C, V), rev(C, V),
                rev(1, K), rev(V, K), state],
      out_specs=[rev(C, K, (0,)), rev(C, K, (0,)), rev(C, K, (0,)), rev(C, C, (0,)),
                 rev(C, V), rev(1, K, (0,)), state],
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((V, K), _f32)],
      compiler_params=_params(1),
      interpret=interpret,
      name="kda_bwd_tpu",
  )(w, q_in, k_out, a_qk, u, do, decay, st, dht_t)
