"""Times the MoE layer forward+backward: sparse (ragged_dot) vs dense one-hot reference.

Usage: python benchmarks/moe_dispatch.py [--experts 16 64 256] [--k 2] [--tokens 2048]
         [--d 64] [--inter 64] [--repeats 5] [--ep 0]
At fixed k and tokens the sparse path's cost should track m k (flat in E, up to the router
and the O(E) bookkeeping) while the dense reference grows like m E.
With --ep G > 0 the layer also runs expert-parallel on a (data=8/G, expert=G) mesh of 8
simulated CPU devices (set before jax starts); on CPU that uses the all_gather emulation of
the ragged all-to-all, so its time shows the emulation's overhead, not a real network.
Prints a table, then one JSON line per row (prefixed "JSON "). Times: median of --repeats
jitted runs after one warm-up (compile excluded), block_until_ready.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _args():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--experts", type=int, nargs="+", default=[16, 64, 256])
  p.add_argument("--k", type=int, default=2)
  p.add_argument("--tokens", type=int, default=2048)
  p.add_argument("--d", type=int, default=64)
  p.add_argument("--inter", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--ep", type=int, default=0, help="expert-parallel size on 8 CPU devices")
  return p.parse_args()


ARGS = _args()
if ARGS.ep:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

# pylint: disable=wrong-import-position,g-import-not-at-top
import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridmoe_jax.config import ComputeConfig, MoEConfig
from hybridmoe_jax.layers.moe import MoE
from hybridmoe_jax.ops.plan import ExecutionPlan, execution_plan
from hybridmoe_jax.parallel.ep_moe import ExpertParallelDispatch
from hybridmoe_jax.parallel.mesh import build_mesh
from benchmarks._timing import time_fn


def build(num_experts: int, impl: str, dispatch=None):
  cfg = MoEConfig(num_experts=num_experts, experts_per_token=ARGS.k,
                  expert_intermediate=ARGS.inter, num_shared_experts=0, latent_dim=0,
                  balancing="qb", qb_num_bins=256)
  model = MoE(ARGS.d, cfg, norm_eps=1e-5, compute=ComputeConfig(moe_impl=impl),
              rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @execution_plan(ExecutionPlan(moe_dispatch=dispatch))
  def loss(params, x, r):
    y, _, _ = nnx.merge(graphdef, params, rest)(x)
    return jnp.sum(y * r)

  return jax.jit(jax.grad(loss, argnums=(0, 1))), params


def main():
  kx, kr = jax.random.split(jax.random.PRNGKey(0))
  b = 8
  x = jax.random.normal(kx, (b, ARGS.tokens // b, ARGS.d), jnp.float32)
  r = jax.random.normal(kr, x.shape, jnp.float32)
  rows = []
  for e in ARGS.experts:
    row = {"bench": "moe_dispatch", "E": e, "k": ARGS.k, "tokens": ARGS.tokens, "d": ARGS.d,
           "inter": ARGS.inter, "backend": jax.default_backend()}
    for impl in ("ragged", "dense"):
      fn, params = build(e, impl)
      first, t = time_fn(fn, (params, x, r), ARGS.repeats)
      row[f"{impl}_ms"] = round(t * 1e3, 3)
      row[f"{impl}_compile_s"] = round(first, 2)
    if ARGS.ep:
      mesh = build_mesh(dict(data=8 // ARGS.ep, fsdp=1, expert=ARGS.ep, tensor=1))
      fn, params = build(e, "ragged", ExpertParallelDispatch(mesh))
      with jax.set_mesh(mesh):
        first, t = time_fn(fn, (params, x, r), ARGS.repeats)
      row["ep"] = ARGS.ep
      row["ep_emulated_ms"] = round(t * 1e3, 3)
    row["dense_over_sparse"] = round(row["dense_ms"] / row["ragged_ms"], 2)
    rows.append(row)
  print(f"{'E':>5} {'k':>3} {'tokens':>7} {'sparse ms':>10} {'dense ms':>10} {'dense/sparse':>13}"
        + ("  ep(emulated) ms" if ARGS.ep else ""))
  for row in rows:
    print(f"{row['E']:>5} {row['k']:>3} {row['tokens']:>7} {row['ragged_ms']:>10.2f} "
          f"{row['dense_ms']:>10.2f} {row['dense_over_sparse']:>13.2f}"
          + (f"  {row['ep_emulated_ms']:>15.2f}" if ARGS.ep else ""))
  for row in rows:
    print("JSON " + json.dumps(row))


if __name__ == "__main__":
  main()
