"""Cost estimates of the TPU KDA kernels (`pl.CostEstimate`), computed from shapes.

XLA cannot see inside a Mosaic custom call: its cost model (cost_analysis()'s flops, bytes
accessed and the TPU's optimal_seconds) takes these numbers as the kernel's work, so they
are counted from the kernel code, not tuned:

* flops: every matmul of the kernel body at its real shape (2 m n k; the 16 x 16 blocks,
  the unit-lower inverses by Neumann product + Newton step, the cumsum matmuls, the
  packed path's identity matmul), plus the elementwise arithmetic on [16, F] blocks and on
  the [V, K] state (`_ELEMENTWISE_PER_BLOCK` operations per element: scaling, decay factors,
  masks, subtractions). Matmuls run at precision HIGHEST (f32, several MXU passes on TPU);
  the count is mathematical flops, as XLA reports for its own HIGHEST dots.
* transcendentals: the exp calls (the backward reuses its forward's exp outputs in the
  derivatives, so it counts only the recomputed forwards).
* bytes_accessed: what the BlockSpecs move between HBM and VMEM: every input block once
  per grid step that reads it (q/k blocks once per value head; the [C, HV] beta block per
  value head), every output block once, states and gradients included.

The backward kernel recomputes, per group of `stride` chunks, the forward of its first
stride - 1 chunks (the states), then runs every chunk's forward again inside jax.vjp and
its transpose: each matmul with two differentiable operands costs twice its forward flops
in the transpose, the cumsum's (constant 0/1 lower-triangular left operand) once, the
packed identity matmul (segment ids, not differentiated) not at all; elementwise work is
counted as three times the forward's (primal, and both sides of each product's rule).
tests/pallas/test_kda_cost.py checks the matmul flops and exp counts against a count over
the traced kernel math (jaxpr), and the elementwise part within 35%.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

SUB = 16
# Elementwise VPU operations per element of a [16, K] / [16, V] block in forward_chunk
# (counted from the code: q scaling, the up/down/ef/k_out/decay_in factors, the masks, the
# beta products, the rhs and output accumulations, the state update).
_ELEMENTWISE_PER_BLOCK = 24


def chunk_matmul_flops(K: int, V: int, nb: int, packed: bool) -> dict[str, int]:
  """Matmul flops of one forward chunk (chunk_math.forward_chunk) of one value head,
  split into 'cumsum' (constant left operand), 'segment' (not differentiated) and 'main'."""
  blk = 2 * SUB * SUB  # a [16, 16] x [16, n] product costs blk * n
  main = 0
  for r in range(nb):
    main += 2 * blk * K  # the diagonal q.k and k.k score blocks
    main += 2 * SUB * K * V  # rhs: beta k e^G S
    main += r * (2 * blk * K + blk * V)  # off-diagonal scores and L_rs Vn_s
    main += 8 * blk * SUB  # (I + L)^-1: 6 Neumann-product matmuls + 2 Newton-step
    main += blk * V  # Vn = inverse @ rhs
    main += 2 * 2 * SUB * K * V  # o = q e^G S and the state update Vn^T k_out
    main += (r + 1) * blk * V  # o += A_qk[r, s] Vn_s
  return dict(main=main, cumsum=nb * blk * K, segment=nb * blk * SUB if packed else 0)


def chunk_exps(K: int, nb: int) -> int:
  """exp evaluations of one forward chunk: e^G_C once, then per 16-row block the factors
  e^G, e^(Gl - g0 - x), e^(g0 + x - Gl), e^(Gl - g0), e^(G_C - G) and one column factor per
  earlier block."""
  return K + nb * 5 * SUB * K + SUB * K * nb * (nb - 1) // 2


def chunk_elementwise(K: int, V: int, nb: int) -> int:
  """Elementwise flops of one forward chunk: the blocks' [16, F] work and the state's
  decay-and-add [V, K]."""
  return nb * _ELEMENTWISE_PER_BLOCK * SUB * (K + V) // 2 + 2 * V * K


def _nbytes(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def _shared(lay, q_dtype, b_dtype, packed: bool) -> float:
  """HBM bytes per token and value head of the blocks shared by several value heads: q, k
  (a step reads hb / rep query heads for hb value heads), beta (the [rows, HV] block, once
  per step of hb heads) and seg (f32, once per step)."""
  rep = lay.HV // lay.H
  return (2 * lay.K * _nbytes(q_dtype) / rep
          + (lay.HV * _nbytes(b_dtype) + 4 * packed) / lay.hb)


def forward_estimate(lay, cfg, q_dtype, v_dtype, g_dtype, b_dtype, *, packed: bool,
                     save_states: bool) -> pl.CostEstimate:
  """CostEstimate of kernel_tpu.forward for the layout `lay` (kernel_tpu.Layout)."""
  C = cfg.chunk_size
  nb, N, heads = C // SUB, lay.tp // C, lay.B * lay.HV
  mm = sum(chunk_matmul_flops(lay.K, lay.V, nb, packed).values())
  flops = heads * N * (mm + chunk_elementwise(lay.K, lay.V, nb))
  per_token = (_shared(lay, q_dtype, b_dtype, packed) + 2 * lay.V * _nbytes(v_dtype)  # v, o
               + lay.K * _nbytes(g_dtype))
  state = lay.V * lay.K * 4
  n_states = 2 + (N // lay.stride if save_states else 0)  # h0, ht, saved states
  return pl.CostEstimate(flops=int(flops),
                         transcendentals=int(heads * N * chunk_exps(lay.K, nb)),
                         bytes_accessed=int(heads * (lay.tp * per_token + n_states * state)))


def backward_estimate(lay, cfg, q_dtype, v_dtype, g_dtype, b_dtype, *,
                      packed: bool) -> pl.CostEstimate:
  """CostEstimate of kernel_tpu.backward (see the module docstring for the count)."""
  C = cfg.chunk_size
  nb, N, heads, m = C // SUB, lay.tp // C, lay.B * lay.HV, lay.stride
  parts = chunk_matmul_flops(lay.K, lay.V, nb, packed)
  fwd_mm = sum(parts.values())
  recompute = (m - 1) / m  # state-only forwards per chunk
  mm = fwd_mm * (1 + recompute) + 2 * parts["main"] + parts["cumsum"]
  elementwise = chunk_elementwise(lay.K, lay.V, nb) * (3 + recompute)
  dqk = 4 if lay.HV != lay.H else _nbytes(q_dtype)
  per_token = (_shared(lay, q_dtype, b_dtype, packed) + 2 * lay.V * _nbytes(v_dtype)  # v, do
               + lay.K * _nbytes(g_dtype) + 2 * lay.K * dqk + lay.V * _nbytes(v_dtype) + lay.K * _nbytes(g_dtype)
               + 4)  # dq, dk, dv, dg, dbeta
  state = lay.V * lay.K * 4
  return pl.CostEstimate(
      flops=int(heads * N * (mm + elementwise)),
      transcendentals=int(heads * N * chunk_exps(lay.K, nb) * (1 + recompute)),
      bytes_accessed=int(heads * (lay.tp * per_token + (N // m + 2) * state)))
