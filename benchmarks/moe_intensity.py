"""Why an FSDP MoE step is bound by HBM, not FLOPs: the routed experts' fwd+bwd for one chip.

Usage: python benchmarks/moe_intensity.py [--tokens 4096 8192] [--chip v5p]

Compiles d(loss)/d(inputs, expert weights) of `ops.grouped_ffn.grouped_ffn` deviceless for
one TPU chip (libtpu, the `[tpu]` extra) at the per-chip shapes of an FSDP layout, where
every chip runs every expert on its own tokens (rows = tokens x top-k), for:
  - ours, Kimi-Linear-48B: 256 experts, top 8, n 2,304, I 1,024;
  - MaxText's anchor, deepseek2-16b: 64 experts, top 6, n 2,048, I 1,408.
Each expert sees about rows / experts rows, and its three weight matrices are read from HBM
in every pass whatever that count is, so the arithmetic intensity of the routed work is
about 2 x rows_per_expert / 2 bytes (bf16 weights) FLOP/byte; below the chip's ridge point
(peak FLOP/s / HBM bytes/s; v5p 459e12 / 2.765e12 = 166) the matmuls wait on HBM.
Prints, per model and token count: rows per expert, the compiler's FLOPs, bytes accessed,
optimal_seconds, FLOP/byte, and the MFU of the routed work alone (the grouped FLOPs
9 x 2 x rows x n x I at the chip's peak over optimal_seconds). All figures are COMPILER
ESTIMATES (libtpu's cost model on a CPU host), not measurements.
Last, the cost model's time for an FSDP-style all-gather (bf16 over 32 chips), the price of
each pass over the weights. Then one JSON line per row (prefixed "JSON ").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {  # name -> (experts, top-k, n, I)
    "kimi_linear_48b": (256, 8, 2304, 1024),
    "maxtext_deepseek2_16b": (64, 6, 2048, 1408),
}


def _args():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192],
                 help="tokens per chip (one 4,096-token row per chip is MaxText's "
                      "per_device_batch_size=1)")
  p.add_argument("--chip", default="v5p", help="TPU generation for the topology (v5p, v4)")
  p.add_argument("--impls", nargs="+", default=["ragged_dot", "megablox"],
                 help="grouped matmuls to compare (ops.grouped_ffn.IMPLS)")
  p.add_argument("--allgather_gb", type=float, default=2.0,
                 help="also cost an all-gather of this many GB of bf16 over a 32-chip slice "
                      "(what FSDP pays per weight pass); 0 skips it")
  return p.parse_args()


def allgather_seconds(gb: float, chip: str) -> float:
  """The cost model's optimal_seconds for all-gathering `gb` GB of bf16 rows split over the
  32 chips of a <chip>:4x4x2 slice onto every chip."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.parallel.topology import topology_devices  # pylint: disable=g-import-not-at-top
  mesh = Mesh(topology_devices(f"{chip}:4x4x2"), ("fsdp",))
  rows = int(gb * 1e9 / 2 / 4096) // 32 * 32
  w = jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  gather = lambda w: jax.lax.with_sharding_constraint(w * 2, NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    compiled = jax.jit(gather).lower(w).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("optimal_seconds", 0.0))


def compiled_cost(experts: int, k: int, n: int, inner: int, tokens: int, chip: str,
                  impl: str) -> dict:
  """The compiler's cost of the routed experts' fwd+bwd on one chip (balanced routing)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.ops.grouped_ffn import grouped_ffn  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.parallel.topology import topology_devices  # pylint: disable=g-import-not-at-top
  mesh = Mesh(topology_devices(f"{chip}:1x1x1")[:1], ("x",))
  put = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
  glu = lambda a, b: jax.nn.silu(a) * b
  rows = tokens * k

  def loss(x, wg, wu, wd, groups):
    y = grouped_ffn(x, groups, wg, wu, wd, glu=glu, dtype=jnp.bfloat16, impl=impl)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  # bf16 weights: what ZeRO-3 gathers for the layer (f32 masters stay sharded).
  args = (put((rows, n), jnp.bfloat16), put((experts, n, inner), jnp.bfloat16),
          put((experts, n, inner), jnp.bfloat16), put((experts, inner, n), jnp.bfloat16),
          put((rows,), jnp.int32))
  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return {k_: float(cost.get(k_, 0.0)) for k_ in ("flops", "bytes accessed", "optimal_seconds")}


def main() -> int:
  args = _args()
  if importlib.util.find_spec("libtpu") is None:
    print("libtpu not installed: pip install -e \".[tpu]\" for the deviceless TPU compile")
    return 0
  from hybridmoe_jax.config.hardware import CHIPS  # pylint: disable=g-import-not-at-top
  spec = CHIPS[f"tpu_{args.chip}"]
  ridge = spec.peak_bf16_flops / spec.hbm_bytes_per_s
  print(f"COMPILER ESTIMATES, one {args.chip} chip, routed experts fwd+bwd (bf16, remat none);"
        f" ridge point {ridge:.0f} FLOP/byte")
  print(f"{'model':24s} {'impl':10s} {'tokens':>6s} {'rows/exp':>8s} {'FLOPs':>10s} {'bytes':>10s} "
        f"{'FLOP/B':>7s} {'opt ms':>8s} {'routed MFU':>10s}")
  rows_out = []
  cases = [(name, dims, impl, tokens) for name, dims in MODELS.items() for impl in args.impls
           for tokens in args.tokens]
  for name, (experts, k, n, inner), impl, tokens in cases:
    c = compiled_cost(experts, k, n, inner, tokens, args.chip, impl)
    grouped = 9 * 2 * tokens * k * n * inner
    opt = c["optimal_seconds"]
    mfu = grouped / spec.peak_bf16_flops / opt if opt > 0 else float("nan")
    row = dict(model=name, impl=impl, tokens=tokens, experts=experts, top_k=k, n=n,
               inner=inner, rows_per_expert=tokens * k / experts, flops=c["flops"],
               bytes=c["bytes accessed"], flop_per_byte=c["flops"] / c["bytes accessed"],
               optimal_ms=opt * 1e3, routed_mfu=mfu, ridge=ridge, chip=args.chip,
               label="COMPILER ESTIMATE")
    rows_out.append(row)
    print(f"{name:24s} {impl:10s} {tokens:6d} {row['rows_per_expert']:8.0f} {c['flops']:10.3e} "
          f"{c['bytes accessed']:10.3e} {row['flop_per_byte']:7.0f} {opt * 1e3:8.2f} "
          f"{mfu:10.1%}", flush=True)
  if args.allgather_gb > 0:
    sec = allgather_seconds(args.allgather_gb, args.chip)
    row = dict(model="allgather_bf16_32_chips", gb=args.allgather_gb, optimal_ms=sec * 1e3,
               gb_per_s=args.allgather_gb / sec if sec > 0 else float("nan"), chip=args.chip,
               label="COMPILER ESTIMATE")
    rows_out.append(row)
    print(f"all-gather of {args.allgather_gb:g} GB bf16 onto each of 32 {args.chip} chips: "
          f"{sec * 1e3:.2f} ms ({row['gb_per_s']:.0f} GB/s)")
  for row in rows_out:
    print("JSON " + json.dumps(row))
  return 0


if __name__ == "__main__":
  sys.exit(main())
