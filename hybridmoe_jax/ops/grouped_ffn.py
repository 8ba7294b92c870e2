"""The grouped (per-expert) GLU FFN over rows: sort by expert, `ragged_dot`, unsort.

The one sparse expert core of the MoE: the local path runs it on the m k token assignments,
the expert-parallel path (`parallel.ep_moe`) on the rows each shard receives. Cost tracks
the number of rows, not rows x experts, forward and backward: the weight gradient of
`ragged_dot` is the grouped transposed matmul (a ragged contraction), 1.0x the grouped FLOPs
on TPU (jax >= 0.11, Mosaic ragged-dot; jax 0.10 compiled it to a dense convolution over
every local expert, 11.2x: tests/ops/test_grouped_ffn.py compiles it for a v5p chip).
Bytes: every intermediate ([N, I] gate / up / GLU, [N, n] output) is in the compute dtype,
with fp32 accumulation only inside the matmuls (as MaxText's MoE); the GLU itself in fp32.
Conventions: N rows, G experts (groups), n = expert input width, I = expert width.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def grouped_ffn(x: jax.Array, groups: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, *, glu: Callable, dtype, rows: jax.Array | None = None
                ) -> jax.Array:
  """y[r] = W_down[g] glu(x_r W_gate[g], x_r W_up[g]) with g = groups[r], x_r = x[rows[r]].

  Args:
    x: [M, n] input rows (any float dtype; the matmuls run in `dtype`).
    groups: [N] int32 expert of each output row in [0, G]; G marks a row to skip (it sorts
      last, outside every group, and its output is unspecified: callers ignore it).
    w_gate, w_up: [G, n, I]; w_down: [G, I, n].
    glu: the gate nonlinearity (`ops.glu.get_glu`), fp32 in and out.
    dtype: matmul and intermediate dtype (fp32 accumulation inside each matmul).
    rows: optional [N] int32 row of `x` feeding output row r (default r, i.e. N = M);
      the local MoE passes assignment // k so tokens are gathered once, already sorted.

  Returns:
    [N, n] in `dtype`, in the order of `groups`.
  """
  num_groups = w_gate.shape[0]
  groups = groups.astype(jnp.int32)
  order = jnp.argsort(groups, stable=True)                    # sorted slot -> row
  src = order if rows is None else jnp.take(rows, order)
  xs = jnp.take(x, src, axis=0).astype(dtype)                 # [N, n], grouped by expert
  sizes = jnp.zeros((num_groups + 1,), jnp.int32).at[groups].add(1)[:num_groups]
  dot = lambda a, w: jax.lax.ragged_dot(a.astype(dtype), w.astype(dtype), sizes,
                                        preferred_element_type=dtype)
  h = glu(dot(xs, w_gate).astype(_F32), dot(xs, w_up).astype(_F32))   # [N, I] fp32, fused
  ys = dot(h, w_down)                                         # [N, n] dtype, sorted
  return jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
