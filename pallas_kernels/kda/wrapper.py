"""custom_vjp glue of the KDA kernels: layouts, forward kernel, recompute-based backward.

Forward: one fused Pallas kernel (kernel_tpu / kernel_gpu .forward), or with
cfg.fused=False XLA chunk_prep + the Pallas recurrence (.recurrent_forward). Residuals are
the inputs only. Packed sequences arrive as `seg` [B, Tp] float32 (segments.py), or None
for the unpacked fast path; they change only the per-chunk math (the fused kernel's masks,
chunk_prep's), never the recurrences over chunks. Backward (README.md):
  1. XLA:    prep, prep_vjp = jax.vjp(reference.chunk_prep, q, k, v, g, beta)
  2. Pallas: the states entering every chunk (forward state recurrence on prep)
  3. Pallas: the reverse recurrence over chunks -> d(prep), dS0
  4. XLA:    dq, dk, dv, dg, dbeta = prep_vjp(d(prep))
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import kernel_gpu, kernel_tpu
from .config import GpuConfig, TpuConfig
from .reference import ChunkPrep, chunk_prep, to_chunks

_f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Static:
  """Hashable non-array arguments of the custom_vjp."""

  backend: str  # "tpu" | "gpu"
  cfg: TpuConfig | GpuConfig
  scale: float
  lower_bound: float
  interpret: bool

  @property
  def kernels(self):
    return kernel_tpu if self.backend == "tpu" else kernel_gpu


def _head_major(x: jax.Array, tp: int, dtype=None) -> jax.Array:
  """[B, T, H, F] -> [B, H, Tp, F], zero-padded along T (optionally cast)."""
  x = x if dtype is None else x.astype(dtype)
  x = jnp.pad(x, ((0, 0), (0, tp - x.shape[1]), (0, 0), (0, 0)))
  return jnp.swapaxes(x, 1, 2)


def _prep(q, k, v, g, beta, seg, st: Static) -> ChunkPrep:
  return chunk_prep(q, k, v, g, beta, seg, scale=st.scale, lower_bound=st.lower_bound,
                    chunk_size=st.cfg.chunk_size)


def _forward_split(q, k, v, g, beta, h0, seg, st: Static):
  """XLA chunk_prep (chunk-parallel) + the Pallas recurrence over chunks."""
  B, T, _, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  prep = _prep(q, k, v, g, beta, seg, st)
  s0_t = jnp.swapaxes(h0.astype(_f32), -1, -2).reshape(B * HV, V, K)
  o, ht_t = st.kernels.recurrent_forward(
      prep.w, prep.u, prep.q_in, prep.k_out, prep.a_qk, prep.decay, s0_t,
      out_dtype=v.dtype, cfg=st.cfg, interpret=st.interpret)
  o = jnp.swapaxes(o.reshape(B, HV, -1, V), 1, 2)[:, :T]
  return o, jnp.swapaxes(ht_t.reshape(B, HV, V, K), -1, -2)


def _forward(q, k, v, g, beta, h0, seg, st: Static):
  if not st.cfg.fused:
    return _forward_split(q, k, v, g, beta, h0, seg, st)
  T, C = q.shape[1], st.cfg.chunk_size
  tp = -(-T // C) * C
  o, ht_t = st.kernels.forward(
      _head_major(q, tp), _head_major(k, tp), _head_major(v, tp),
      _head_major(g, tp, _f32), _head_major(beta[..., None], tp, _f32),
      jnp.swapaxes(h0.astype(_f32), -1, -2),
      None if seg is None else seg[..., None],
      cfg=st.cfg, scale=st.scale, lower_bound=st.lower_bound, interpret=st.interpret,
  )
  return jnp.swapaxes(o, 1, 2)[:, :T], jnp.swapaxes(ht_t, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def kda_core(q, k, v, g, beta, h0, seg, st: Static):
  """(o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] f32); h0 is required;
  seg [B, Tp] float32 (segments.chunk_local_segments) or None (unpacked)."""
  return _forward(q, k, v, g, beta, h0, seg, st)


def _fwd(q, k, v, g, beta, h0, seg, st):
  return _forward(q, k, v, g, beta, h0, seg, st), (q, k, v, g, beta, h0, seg)


def _bwd(st: Static, res, cts):
  q, k, v, g, beta, h0, seg = res
  do, dht = cts
  B, _, _, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  C = st.cfg.chunk_size
  prep, prep_vjp = jax.vjp(functools.partial(_prep, seg=seg, st=st), q, k, v, g, beta)
  s0_t = jnp.swapaxes(h0.astype(_f32), -1, -2).reshape(B * HV, V, K)
  kern = st.kernels
  states = kern.states(prep.w, prep.u, prep.k_out, prep.decay, s0_t, cfg=st.cfg,
                       interpret=st.interpret)
  dht_t = jnp.swapaxes(dht.astype(_f32), -1, -2).reshape(B * HV, V, K)
  dw, dq_in, dk_out, da, du, ddecay, ds0_t = kern.backward(
      prep.w, prep.q_in, prep.k_out, prep.a_qk, prep.u, to_chunks(do, C), prep.decay,
      states, dht_t, cfg=st.cfg, interpret=st.interpret,
  )
  d_prep = ChunkPrep(w=dw.sum(0), u=du, q_in=dq_in.sum(0), k_out=dk_out.sum(0),
                     a_qk=da.sum(0), decay=ddecay.sum(0))
  dq, dk, dv, dg, dbeta = prep_vjp(d_prep)
  dh0 = jnp.swapaxes(ds0_t.reshape(B, HV, V, K), -1, -2)
  grads = (dq, dk, dv, dg, dbeta, dh0)
  grads = tuple(d.astype(x.dtype) for d, x in zip(grads, res))
  return grads + (None if seg is None else jnp.zeros_like(seg),)


kda_core.defvjp(_fwd, _bwd)
