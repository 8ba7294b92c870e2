"""The grouped (per-expert) GLU FFN over rows: sort by expert, `ragged_dot`, unsort.

The one sparse expert core of the MoE: the local path runs it on the m k token assignments,
the expert-parallel path (`parallel.ep_moe`) on the rows each shard receives. Cost tracks
the number of rows, not rows x experts, forward and backward: the weight gradient of
`ragged_dot` is the grouped transposed matmul (a ragged contraction), 1.0x the grouped FLOPs
on TPU (jax >= 0.11, Mosaic ragged-dot; jax 0.10 compiled it to a dense convolution over
every local expert, 11.2x: tests/ops/test_grouped_ffn.py compiles it for a v5p chip).
Bytes: every intermediate ([N, I] gate / up / GLU, [N, n] output) is in the compute dtype,
with fp32 accumulation only inside the matmuls (as MaxText's MoE); the GLU itself in fp32.
The grouped matmul has two implementations (`IMPLS`, chosen by `choose`):
  "ragged_dot": `jax.lax.ragged_dot`, XLA's own (every platform). On TPU its input gradient
    contracts the weights over their last dim, which the Mosaic kernel cannot read in place:
    XLA copies each [G, n, I] weight transposed first (a full read + write per matmul).
  "megablox": jax's Pallas TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox`,
    part of jax, what MaxText's MoE runs) with its custom VJP: the input gradient reads the
    weights transposed inside the kernel's tiles (no copy), the weight gradient is its
    grouped transposed matmul. TPU only (a Mosaic kernel; interpret mode elsewhere, for
    tests). At the Kimi-Linear-48B fsdp shapes (4,096 tokens x top 8, 256 experts) the
    layer's fwd+bwd costs 9.42 ms vs 11.39 ms by libtpu's cost model (COMPILER ESTIMATES,
    `benchmarks/moe_intensity.py`).
Conventions: N rows, G experts (groups), n = expert input width, I = expert width.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from hybridmoe_jax.ops.platform import target_platform

_F32 = jnp.float32
IMPLS = ("auto", "ragged_dot", "megablox")
# Megablox tiles (rows, contraction, output): the lowest cost-model step of those tried at the
# 48B fsdp shapes (128/256/512 rows x 1,024 x 1,024: 11.74 / 10.19 / 9.42 ms, COMPILER
# ESTIMATES); `_megablox_tiling` fits them to each matmul.
_TILE = (512, 1024, 1024)


def choose(impl: str = "auto", platform: str | None = None) -> tuple[str, str]:
  """The grouped matmul for the program being traced (or for `platform`) -> (name, reason).
  "auto": megablox on TPU, ragged_dot elsewhere; a named impl is used as asked (megablox off
  TPU runs the kernel in interpret mode: tests only)."""
  if impl not in IMPLS:
    raise ValueError(f"grouped matmul impl={impl!r} is invalid: allowed {IMPLS}")
  if impl != "auto":
    return impl, f"{impl} (compute.grouped_matmul)"
  platform, where = target_platform() if platform is None else (platform, "given")
  if platform == "tpu":
    return "megablox", ("megablox: jax's Pallas TPU grouped matmul (its input gradient reads "
                        "the weights transposed in-kernel; ragged_dot copies them); ragged_dot "
                        "where widths are not multiples of 128")
  return "ragged_dot", f"ragged_dot: XLA's grouped matmul ({platform}, {where})"


def _megablox_tiling(rows: int, k: int, n: int) -> tuple[int, int, int] | None:
  """Megablox tiles for a [rows, k] x [G, k, n] matmul, or None where the kernel cannot run.

  Its custom VJP reuses the tiles for the transposed problem ([rows, n] x [G, k, n]^T), so
  the contraction and output tiles are one size, valid for both: k and n multiples of 128
  (Mosaic's lane width), the tile min(1,024, k, n); rows a multiple of 8, the row tile the
  largest of 512 ... 8 dividing them."""
  if k % 128 or n % 128:
    return None
  tm = next((t for t in (512, 256, 128, 64, 32, 16, 8) if t <= _TILE[0] and rows % t == 0),
            None)
  if tm is None:
    return None
  t = min(_TILE[1], k, n)
  return tm, t, t


def _grouped_matmul(impl: str, dtype):
  """-> dot(a [N, K], w [G, K, M], sizes [G] int32) -> [N, M] in `dtype` (fp32 accumulation
  inside), rows grouped in order of `sizes`; rows past sum(sizes) unspecified."""
  ragged = lambda a, w, sizes: jax.lax.ragged_dot(a.astype(dtype), w.astype(dtype), sizes,
                                                  preferred_element_type=dtype)
  if impl != "megablox":
    return ragged
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox  # pylint: disable=g-import-not-at-top
  interpret = target_platform()[0] != "tpu"

  def dot(a, w, sizes):
    tiling = _megablox_tiling(a.shape[0], w.shape[1], w.shape[2])
    if tiling is None:  # shapes the kernel cannot tile: XLA's matmul (exact, only slower)
      return ragged(a, w, sizes)
    return megablox.gmm(a.astype(dtype), w.astype(dtype), sizes, dtype, tiling, None, None,
                        False, interpret)
  return dot


def grouped_ffn(x: jax.Array, groups: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, *, glu: Callable, dtype, rows: jax.Array | None = None,
                impl: str = "auto") -> jax.Array:
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
    impl: the grouped matmul (`IMPLS`; "auto" = `choose`'s pick for the target platform).

  Returns:
    [N, n] in `dtype`, in the order of `groups`.
  """
  num_groups = w_gate.shape[0]
  groups = groups.astype(jnp.int32)
  order = jnp.argsort(groups, stable=True)                    # sorted slot -> row
  src = order if rows is None else jnp.take(rows, order)
  xs = jnp.take(x, src, axis=0).astype(dtype)                 # [N, n], grouped by expert
  sizes = jnp.zeros((num_groups + 1,), jnp.int32).at[groups].add(1)[:num_groups]
  name = choose(impl)[0]
  matmul = _grouped_matmul(name, dtype)
  dot = lambda a, w: matmul(a, w, sizes)
  if name == "megablox":
    # The kernel leaves rows past sum(sizes) (skipped rows) unwritten, forward and backward:
    # zero them where they enter and leave, so neither y nor dx can carry that memory.
    kept = (jnp.arange(xs.shape[0], dtype=jnp.int32) < jnp.sum(sizes))[:, None]
    xs = jnp.where(kept, xs, jnp.zeros((), dtype))
  h = glu(dot(xs, w_gate).astype(_F32), dot(xs, w_up).astype(_F32))   # [N, I] fp32, fused
  ys = dot(h, w_down)                                         # [N, n] dtype, sorted
  if name == "megablox":
    ys = jnp.where(kept, ys, jnp.zeros((), ys.dtype))
  return jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
