"""KDA kernels for GPU: Pallas with the Triton compiler (`plgpu.CompilerParams`).

One program per (batch, value head, value tile of BV); each program walks the chunks in a
`lax.fori_loop` with its fp32 state tile St = S^T [BV, K] as the loop carry (registers:
Triton has no scratch memory). Blocks cover the whole (padded) sequence of one head; chunks
and 16-row sub-blocks are read with `pl.ds` (Triton cannot slice values).

Layouts (prepared by wrapper.py): forward q, k [B, H, Tp, K]; v [B, HV, Tp, V];
g [B, HV, Tp, K] f32; beta [B, HV, Tp, 1] f32; states transposed [.., V, K] f32.
Backward kernels read chunk layout [B*HV, N, C, F] (reference.chunk_prep) and return the
K-side gradients per value tile ([NV, B*HV, ...], summed by the caller).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .chunk_math import SUB, backward_chunk, forward_chunk, output_chunk, states_chunk
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


def _chunk_specs(N, C, K, BV):
  """Block specs over the chunk layout [BH, N, C, F] for grid (BH, NV)."""
  k_side = pl.BlockSpec((None, N, C, K), lambda i, j: (i, 0, 0, 0))
  v_side = pl.BlockSpec((None, N, C, BV), lambda i, j: (i, 0, 0, j))
  decay = pl.BlockSpec((None, N, 1, K), lambda i, j: (i, 0, 0, 0))
  state = pl.BlockSpec((None, BV, K), lambda i, j: (i, j, 0))
  states = pl.BlockSpec((None, N, BV, K), lambda i, j: (i, 0, j, 0))
  return k_side, v_side, decay, state, states


def states(w, u, k_out, decay, s0t, *, cfg: GpuConfig, interpret: bool):
  """States entering each chunk: St [BH, N, V, K] f32 from chunk_prep's w, u, k_out, decay."""
  BH, N, C, K = w.shape
  V, BV = u.shape[-1], cfg.block_v
  prec = lax_precision(cfg.precision)
  k_side, v_side, decay_spec, state, states_spec = _chunk_specs(N, C, K, BV)

  def kernel(w_ref, u_ref, ko_ref, d_ref, s0_ref, st_ref):
    def body(n, St):
      st_ref[n] = St
      return states_chunk(w_ref[n], u_ref[n], ko_ref[n], d_ref[n], St, prec)

    lax.fori_loop(0, N, body, s0_ref[...])

  return pl.pallas_call(
      kernel,
      grid=(BH, V // BV),
      in_specs=[k_side, v_side, k_side, decay_spec, state],
      out_specs=states_spec,
      out_shape=jax.ShapeDtypeStruct((BH, N, V, K), _f32),
      compiler_params=_params(cfg),
      interpret=interpret,
      name="kda_states_gpu",
  )(w, u, k_out, decay, s0t)


def recurrent_forward(w, u, q_in, k_out, a_qk, decay, s0t, *, out_dtype, cfg: GpuConfig,
                      interpret: bool):
  """Split forward's recurrence: (o [BH, N, C, V] in out_dtype, final St [BH, V, K] f32)."""
  BH, N, C, K = w.shape
  V, BV = u.shape[-1], cfg.block_v
  prec = lax_precision(cfg.precision)
  k_side, v_side, decay_spec, state, _ = _chunk_specs(N, C, K, BV)

  def kernel(w_ref, u_ref, qi_ref, ko_ref, a_ref, d_ref, s0_ref, o_ref, ht_ref):
    def body(n, St):
      o, St = output_chunk(w_ref[n], u_ref[n], qi_ref[n], ko_ref[n], a_ref[n], d_ref[n],
                           St, prec)
      o_ref[n] = o.astype(o_ref.dtype)
      return St

    ht_ref[...] = lax.fori_loop(0, N, body, s0_ref[...])

  return pl.pallas_call(
      kernel,
      grid=(BH, V // BV),
      in_specs=[k_side, v_side, k_side, k_side,
                pl.BlockSpec((None, N, C, C), lambda i, j: (i, 0, 0, 0)), decay_spec, state],
      out_specs=[v_side, state],
      out_shape=[jax.ShapeDtypeStruct((BH, N, C, V), out_dtype),
                 jax.ShapeDtypeStruct((BH, V, K), _f32)],
      compiler_params=_params(cfg),
      interpret=interpret,
      name="kda_recurrent_fwd_gpu",
  )(w, u, q_in, k_out, a_qk, decay, s0t)


def backward(w, q_in, k_out, a_qk, u, do, decay, st, dht_t, *, cfg: GpuConfig,
             interpret: bool):
  """Reverse chunk recurrence. Returns (dw, dq_in, dk_out [NV, BH, N, C, K],
  da [NV, BH, N, C, C], du [BH, N, C, V], ddecay [NV, BH, N, 1, K], dS0t [BH, V, K])."""
  BH, N, C, K = w.shape
  V, BV = u.shape[-1], cfg.block_v
  NV = V // BV
  prec = lax_precision(cfg.precision)
  k_side, v_side, decay_spec, state, states_spec = _chunk_specs(N, C, K, BV)
  a_spec = pl.BlockSpec((None, N, C, C), lambda i, j: (i, 0, 0, 0))

  def part(f):  # per-value-tile partial sums: [NV, BH, N, C, f]
    return pl.BlockSpec((None, None, N, C, f), lambda i, j: (j, i, 0, 0, 0))

  def kernel(w_ref, qi_ref, ko_ref, a_ref, u_ref, do_ref, d_ref, st_ref, dht_ref,
             dw_ref, dqi_ref, dko_ref, da_ref, du_ref, dd_ref, ds0_ref):
    def body(i, dSt):
      n = N - 1 - i
      outs = backward_chunk(w_ref[n], qi_ref[n], ko_ref[n], a_ref[n], u_ref[n],
                            do_ref[n].astype(_f32), d_ref[n], st_ref[n], dSt, prec)
      for ref, x in zip((dw_ref, dqi_ref, dko_ref, da_ref, du_ref, dd_ref), outs[:6]):
        ref[n] = x
      return outs[6]

    ds0_ref[...] = lax.fori_loop(0, N, body, dht_ref[...])

  out_shape = [jax.ShapeDtypeStruct((NV, BH, N, C, f), _f32) for f in (K, K, K, C)]
  out_shape += [jax.ShapeDtypeStruct((BH, N, C, V), _f32),
                jax.ShapeDtypeStruct((NV, BH, N, 1, K), _f32),
                jax.ShapeDtypeStruct((BH, V, K), _f32)]
  return pl.pallas_call(
      kernel,
      grid=(BH, NV),
      in_specs=[k_side, k_side, k_side, a_spec, v_side, v_side, decay_spec, states_spec,
                state],
      out_specs=[part(K), part(K), part(K), part(C), v_side,
                 pl.BlockSpec((None, None, N, 1, K), lambda i, j: (j, i, 0, 0, 0)), state],
      out_shape=out_shape,
      compiler_params=_params(cfg),
      interpret=interpret,
      name="kda_bwd_gpu",
  )(w, q_in, k_out, a_qk, u, do, decay, st, dht_t)
