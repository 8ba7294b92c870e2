"""The KDA Pallas kernels' entry point `kda_pallas` and its custom_vjp: layouts, forward
kernel, recompute-based backward.

This library runs the backend it is given and does not choose: the op
(hybridmoe_jax/ops/kda/api.py) picks the backend, checks the inputs once and asks
`config.check_domain_dims` first. Conventions (DESIGN s1): q, k [B, T, H, K] L2-normalised;
v [B, T, HV, V]; g [B, T, HV, K] log decay in [lower_bound, 0]; beta [B, T, HV];
state [B, HV, K, V] float32.

Forward: one fused Pallas kernel (kernel_tpu / kernel_gpu .forward), or with
cfg.fused=False XLA chunk_prep + the Pallas recurrence (.recurrent_forward). Residuals are
the inputs only. Packed sequences arrive as `seg` [B, Tp] float32 (segments.py), or None
for the unpacked fast path; they change only the per-chunk math (the fused kernel's masks,
chunk_prep's), never the recurrences over chunks. Backward (README.md):
  1. XLA:    prep, prep_vjp = jax.vjp(prep.chunk_prep, q, k, v, g, beta)
  2. Pallas: the states entering every chunk (forward state recurrence on prep)
  3. Pallas: the reverse recurrence over chunks -> d(prep), dS0
  4. XLA:    dq, dk, dv, dg, dbeta = prep_vjp(d(prep))
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from . import cost, kernel_gpu, kernel_tpu
from .config import GpuConfig, TpuConfig, default_gpu_config, default_tpu_config
from .prep import ChunkPrep, chunk_prep
from .segments import chunk_local_segments

_f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Static:
  """Hashable non-array arguments of the custom_vjp."""

  backend: Literal["tpu", "gpu"]
  cfg: TpuConfig | GpuConfig
  scale: float
  lower_bound: float
  interpret: bool


def _head_major(x: jax.Array, tp: int, dtype=None) -> jax.Array:
  """[B, T, H, F] -> [B, H, Tp, F], zero-padded along T (optionally cast)."""
  x = x if dtype is None else x.astype(dtype)
  x = jnp.pad(x, ((0, 0), (0, tp - x.shape[1]), (0, 0), (0, 0)))
  return jnp.swapaxes(x, 1, 2)


def _flat_t(s: jax.Array) -> jax.Array:
  """State [B, HV, K, V] -> the kernels' transposed, flattened [B*HV, V, K] float32."""
  return jnp.swapaxes(s.astype(_f32), -1, -2).reshape(-1, *s.shape[:-3:-1])


def _unflat_t(st: jax.Array, B: int) -> jax.Array:
  """Inverse of _flat_t: [B*HV, V, K] -> [B, HV, K, V]."""
  return jnp.swapaxes(st.reshape(B, -1, *st.shape[1:]), -1, -2)


def _prep(q, k, v, g, beta, seg, st: Static) -> ChunkPrep:
  return chunk_prep(q, k, v, g, beta, seg, scale=st.scale, lower_bound=st.lower_bound,
                    chunk_size=st.cfg.chunk_size)


def _forward_split(q, k, v, g, beta, h0, seg, st: Static):
  """XLA chunk_prep (chunk-parallel) + the Pallas recurrence over chunks."""
  B, T = q.shape[:2]
  HV, V = v.shape[2], v.shape[3]
  if st.backend == "gpu":  # one slice of chunks at a time (kernel_gpu.SLICE_CHUNKS)
    o, ht_t = kernel_gpu.sliced_forward(q, k, v, g, beta, seg, _flat_t(h0),
                                        prep_fn=functools.partial(_prep, st=st), cfg=st.cfg,
                                        interpret=st.interpret)
    return o, _unflat_t(ht_t, B)
  tp = padded_length(T, st.backend, st.cfg)  # seg's length
  prep = _prep(*(_pad_t(x, tp) for x in (q, k, v, g, beta)), seg, st)
  o, ht_t = kernel_tpu.recurrent_forward(
      prep.w, prep.u, prep.q_in, prep.k_out, prep.a_qk, prep.decay, _flat_t(h0),
      out_dtype=v.dtype, cfg=st.cfg, interpret=st.interpret)
  return jnp.swapaxes(o.reshape(B, HV, -1, V), 1, 2)[:, :T], _unflat_t(ht_t, B)


def padded_length(T: int, backend: str, cfg: TpuConfig | GpuConfig) -> int:
  """T rounded up to whole kernel blocks: chunks (GPU) or groups of cfg.state_stride chunks
  (TPU: the backward's grid step and the spacing of the saved states). Sequences shorter
  than one group use a stride of one chunk."""
  C = cfg.chunk_size
  n = -(-T // C)
  return n * C if backend == "gpu" else -(-n // tpu_stride(n, cfg)) * tpu_stride(n, cfg) * C


def tpu_stride(n_chunks: int, cfg: TpuConfig) -> int:
  return cfg.state_stride if n_chunks >= cfg.state_stride else 1


def _tpu_layout(q, v, st: Static) -> kernel_tpu.Layout:
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  return kernel_tpu.Layout(B=B, tp=padded_length(T, "tpu", st.cfg), H=H, HV=HV, K=K, V=V,
                           stride=tpu_stride(-(-T // st.cfg.chunk_size), st.cfg))


def _pad_t(x: jax.Array, tp: int) -> jax.Array:
  """Zero-pads axis 1 (tokens) to tp: padded tokens are no-ops (q = k = v = g = beta = 0)."""
  pad = [(0, 0), (0, tp - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
  return x if tp == x.shape[1] else jnp.pad(x, pad)


def _tpu_forward(q, k, v, g, beta, h0, seg, st: Static, save_states: bool):
  lay = _tpu_layout(q, v, st)
  T = q.shape[1]
  outs = kernel_tpu.forward(
      *(_pad_t(x, lay.tp) for x in (q, k, v, g, beta)), jnp.swapaxes(h0.astype(_f32), -1, -2),
      None if seg is None else seg[..., None], lay=lay, cfg=st.cfg, scale=st.scale,
      lower_bound=st.lower_bound, interpret=st.interpret, save_states=save_states,
      cost=cost.forward_estimate(lay, st.cfg, q.dtype, v.dtype, g.dtype, beta.dtype,
                                 packed=seg is not None, save_states=save_states))
  out = (outs[0][:, :T], jnp.swapaxes(outs[1], -1, -2))
  return out, (outs[2] if save_states else None)


def _tpu_backward(res, cts, st: Static):
  q, k, v, g, beta, h0, seg, states = res
  do, dht = cts
  lay = _tpu_layout(q, v, st)
  T, rep = q.shape[1], lay.HV // lay.H
  dq, dk, dv, dg, dbeta, ds0 = kernel_tpu.backward(
      *(_pad_t(x, lay.tp) for x in (q, k, v, g, beta)),
      None if seg is None else seg[..., None], _pad_t(do.astype(v.dtype), lay.tp), states,
      jnp.swapaxes(dht.astype(_f32), -1, -2), lay=lay, cfg=st.cfg, scale=st.scale,
      lower_bound=st.lower_bound, interpret=st.interpret,
      cost=cost.backward_estimate(lay, st.cfg, q.dtype, v.dtype, g.dtype, beta.dtype,
                                  packed=seg is not None))

  def per_q_head(x):  # [B, Tp, HV, K] per value head -> [B, T, H, K]: sum over the group
    x = x[:, :T]
    return x if rep == 1 else x.reshape(*x.shape[:2], lay.H, rep, -1).sum(3)

  dbeta = jnp.moveaxis(dbeta, 1, 2).reshape(lay.B, lay.tp, lay.HV)[:, :T]  # [B, T, HV]
  return (per_q_head(dq), per_q_head(dk), dv[:, :T], dg[:, :T], dbeta,
          jnp.swapaxes(ds0, -1, -2))


def _forward(q, k, v, g, beta, h0, seg, st: Static):
  if not st.cfg.fused:
    return _forward_split(q, k, v, g, beta, h0, seg, st)
  if st.backend == "tpu":
    return _tpu_forward(q, k, v, g, beta, h0, seg, st, save_states=False)[0]
  T, C = q.shape[1], st.cfg.chunk_size
  tp = -(-T // C) * C
  o, ht_t = kernel_gpu.forward(
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
  seg [B, Tp] float32 (segments.chunk_local_segments, Tp = padded_length) or None."""
  return _forward(q, k, v, g, beta, h0, seg, st)


def _split_states(q, k, v, g, beta, h0, seg, st: Static):
  """The states the TPU backward needs, [B, HV, N / stride, V, K], for the split forward
  (which does not produce them): XLA chunk_prep + the Pallas state recurrence."""
  B, HV, V, K = v.shape[0], v.shape[2], v.shape[3], q.shape[3]
  lay = _tpu_layout(q, v, st)
  prep = _prep(*(_pad_t(x, lay.tp) for x in (q, k, v, g, beta)), seg, st)
  states = kernel_tpu.states(prep.w, prep.u, prep.k_out, prep.decay, _flat_t(h0), cfg=st.cfg,
                             interpret=st.interpret)
  return states[:, ::lay.stride].reshape(B, HV, -1, V, K)


def _fwd(q, k, v, g, beta, h0, seg, st):
  if st.backend != "tpu":
    return _forward(q, k, v, g, beta, h0, seg, st), (q, k, v, g, beta, h0, seg, None)
  if st.cfg.fused:
    out, states = _tpu_forward(q, k, v, g, beta, h0, seg, st, save_states=True)
  else:
    out = _forward_split(q, k, v, g, beta, h0, seg, st)
    states = _split_states(q, k, v, g, beta, h0, seg, st)
  return out, (q, k, v, g, beta, h0, seg, states)


def _bwd(st: Static, res, cts):
  grads = (_tpu_backward if st.backend == "tpu" else _gpu_backward)(res, cts, st)
  grads = tuple(d.astype(x.dtype) for d, x in zip(grads, res))
  seg = res[6]
  return grads + (None if seg is None else jnp.zeros_like(seg),)


def _gpu_backward(res, cts, st: Static):
  """Steps 1-4 of the module docstring, one slice of chunks at a time
  (kernel_gpu.sliced_backward; GPU: Triton has no value slicing, so the in-kernel vjp of
  the TPU backward is not available)."""
  q, k, v, g, beta, h0, seg, _ = res
  do, dht = cts
  grads, ds0_t = kernel_gpu.sliced_backward(
      q, k, v, g, beta, seg, _flat_t(h0), do, _flat_t(dht),
      prep_fn=functools.partial(_prep, st=st), cfg=st.cfg, interpret=st.interpret)
  return (*grads, _unflat_t(ds0_t, q.shape[0]))


kda_core.defvjp(_fwd, _bwd)


def kda_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    backend: Literal["tpu", "gpu"],
    lower_bound: float,
    interpret: bool = False,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    config: TpuConfig | GpuConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Kimi Delta Attention (arXiv:2510.26692) with bounded gates, as a Pallas kernel.

  Per token: S <- diag(e^g) S; S <- S + beta k (v - k^T S)^T; o = scale q^T S, computed
  chunkwise (DESIGN s1.1-1.2); differentiable (custom_vjp) in q, k, v, g, beta and the
  initial state. The caller has checked the shapes and the domain (module docstring).

  Args:
    q, k: [B, T, H, K] L2-normalised queries/keys (float32 / bfloat16 / float16).
    v: [B, T, HV, V] values, HV a multiple of H.
    g: [B, T, HV, K] log decay in [lower_bound, 0] (float32 recommended).
    beta: [B, T, HV] write strength.
    backend: "tpu" (Mosaic) or "gpu" (Triton).
    lower_bound: the bounded gate's lb in [-5, 0).
    interpret: run the kernels with interpret=True (on a CPU).
    scale: query scale; defaults to K ** -0.5.
    initial_state: optional [B, HV, K, V] state (float32).
    output_final_state: also return the final state.
    segment_ids: optional [B, T] integer ids of packed documents: the state resets where
      the id changes (token 0 keeps initial_state) and documents never interact. None
      compiles the unpacked kernels, with no segment masks.
    chunk_size: C in config.SUPPORTED_CHUNKS.
    config: block sizes (TpuConfig / GpuConfig for the backend); default heuristic.

  Returns:
    (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] float32 or None).

  Raises:
    ValueError: a backend other than "tpu" / "gpu", or a config of another backend or
      chunk size.
  """
  if backend not in ("tpu", "gpu"):
    raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}")
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  if config is None:
    config = (default_tpu_config(chunk_size=chunk_size, dtype=q.dtype) if backend == "tpu"
              else default_gpu_config(chunk_size=chunk_size, k=K, v=V, dtype=q.dtype))
  expected = TpuConfig if backend == "tpu" else GpuConfig
  if not isinstance(config, expected) or config.chunk_size != chunk_size:
    raise ValueError(f"config must be a {expected.__name__} with chunk_size={chunk_size}, "
                     f"got {config!r}")
  if isinstance(config, GpuConfig) and V % config.block_v:
    raise ValueError(f"block_v={config.block_v} must divide V={V}")
  st = Static(backend=backend, cfg=config, scale=float(K**-0.5 if scale is None else scale),
              lower_bound=float(lower_bound), interpret=bool(interpret))
  h0 = jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None else initial_state
  seg = None
  if segment_ids is not None:  # padding tokens continue the last segment (segments.py)
    tp = padded_length(T, backend, config)
    seg = chunk_local_segments(jnp.pad(segment_ids, ((0, 0), (0, tp - T)), mode="edge"),
                               chunk_size)
  o, ht = kda_core(q, k, v, g, beta, h0, seg, st)
  return o, (ht if output_final_state else None)
