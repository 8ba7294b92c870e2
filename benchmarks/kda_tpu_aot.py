"""KDA on TPU by the compiler's own figures: the Pallas (Mosaic) kernel vs the chunked XLA
path, compiled ahead of time for a TPU topology on a CPU-only machine (deviceless AOT).

Usage:  nice -n 19 python benchmarks/kda_tpu_aot.py [--T 8192 32768 131072]
            [--topology v5p:2x2x1] [--modes fwd fwdbwd] [--packing unpacked packed]
            [--out kda_tpu_aot.jsonl]
Needs libtpu (`pip install "jax[tpu]"`); runs with JAX_PLATFORMS=cpu (the topology's devices
come from hybridmoe_jax.parallel.topology, which sets libtpu's environment for a CPU host). Shapes: B=1, H=HV=16, K=V=128, q/k/v/beta bf16, gates fp32 (the
model computes them in fp32) bounded by lb=-5, chunk 64. Packed: segment_ids [B, T] int32
are an argument (the compile does not depend on their values).

For each (T, packing, mode) both implementations are jitted on one chip of the topology
(`jax.set_mesh` so Pallas lowers for the TPU kind) with replicated shardings, lowered from
ShapeDtypeStructs and compiled by libtpu. fwd = o = kda(q, k, v, g, beta); fwdbwd = the
gradients of sum(o) w.r.t. q, k, v, g, beta. One JSON line per compile (prefixed "JSON "):
temp / argument / output bytes (compiled.memory_analysis()), flops, bytes accessed and
optimal_seconds (compiled.cost_analysis(); the TPU cost model's time, which for a Mosaic
custom call comes from its pl.CostEstimate: pallas_kernels/kda/cost.py), the compile time,
whether a Mosaic custom call is in the optimised HLO, then one "ratio" line per pair with
pallas / xla for temp bytes and optimal_seconds (< 1: the kernel wins). XLA's cost analysis
counts a loop body once: the XLA path's costs count every step of its chunk scan (compiled
with the scan unrolled 1 and 2 steps per iteration; `compile_one`).
These are compiler estimates, not measurements: no TPU ran anything.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridmoe_jax.ops.kda.chunked import kda_chunked, scan_steps
from hybridmoe_jax.parallel.topology import topology_devices
from hybridmoe_jax.tools.timing import stopwatch
from pallas_kernels.kda import kda_pallas

LB, C, H, K, V, B = -5.0, 64, 16, 128, 128, 1


def tpu_mesh(topology: str) -> Mesh:
  """A one-device mesh of the topology's first chip (deviceless: no TPU needed)."""
  return Mesh(np.array(topology_devices(topology)[:1]).reshape(1), ("x",))


def arg_specs(T: int, packed: bool):
  bf16 = jnp.bfloat16
  specs = [jax.ShapeDtypeStruct((B, T, H, K), bf16), jax.ShapeDtypeStruct((B, T, H, K), bf16),
           jax.ShapeDtypeStruct((B, T, H, V), bf16),
           jax.ShapeDtypeStruct((B, T, H, K), jnp.float32),
           jax.ShapeDtypeStruct((B, T, H), bf16)]
  if packed:
    specs.append(jax.ShapeDtypeStruct((B, T), jnp.int32))
  return specs


def kda_fn(impl: str, unroll: int = 1):
  def run(q, k, v, g, beta, seg=None):
    kw = dict(segment_ids=seg, chunk_size=C, lower_bound=LB)
    if impl == "pallas":
      return kda_pallas(q, k, v, g, beta, backend="tpu", interpret=False, **kw)[0]
    return kda_chunked(q, k, v, g, beta, unroll=unroll, **kw)[0]

  return run


def program(impl: str, mode: str, unroll: int = 1):
  run = kda_fn(impl, unroll)
  if mode == "fwd":
    return run

  def fwdbwd(q, k, v, g, beta, *seg):
    loss = lambda *x: jnp.sum(run(*x, *seg).astype(jnp.float32))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

  return fwdbwd


_COSTS = (("flops", "flops"), ("bytes_accessed", "bytes accessed"),
          ("transcendentals", "transcendentals"), ("optimal_seconds", "optimal_seconds"))


def _compile(mesh: Mesh, impl: str, mode: str, specs, unroll: int):
  rep = NamedSharding(mesh, PartitionSpec())
  with jax.set_mesh(mesh):
    fn = jax.jit(program(impl, mode, unroll), in_shardings=(rep,) * len(specs))
    compiled = fn.lower(*specs).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return compiled, {k: float(cost.get(name, -1)) for k, name in _COSTS}


def compile_one(mesh: Mesh, impl: str, mode: str, T: int, packed: bool) -> dict:
  """One program's compiler figures. The XLA path's scan body is costed once by XLA, so it
  is compiled again with 2 steps per iteration and the difference (one step) is counted
  scan_steps - 1 more times ("loop_costed"); its memory is the unroll-1 compile's."""
  specs = arg_specs(T, packed)
  with stopwatch() as sw:
    compiled, cost = _compile(mesh, impl, mode, specs, 1)
    steps = scan_steps(T, C) if impl == "xla" else 1
    if steps > 1:
      _, cost2 = _compile(mesh, impl, mode, specs, 2)
      cost = {k: v + (steps - 1) * (cost2[k] - v) if v >= 0 and cost2[k] >= 0 else v
              for k, v in cost.items()}
  mem = compiled.memory_analysis()
  hlo = compiled.as_text()
  return dict(
      impl=impl, mode=mode, T=T, packing="packed" if packed else "unpacked",
      temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes),
      output_bytes=int(mem.output_size_in_bytes), **cost, loop_costed=steps > 1,
      mosaic_calls=hlo.count('custom_call_target="tpu_custom_call"'),
      compile_s=round(sw.seconds, 1))


def emit(row: dict, out) -> None:
  line = json.dumps(row)
  print("JSON " + line, flush=True)
  if out:
    with open(out, "a") as f:
      f.write(line + "\n")


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
  p.add_argument("--topology", default="v5p:2x2x1")
  p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
  p.add_argument("--packing", nargs="+", default=["unpacked", "packed"],
                 choices=["unpacked", "packed"])
  p.add_argument("--impls", nargs="+", default=["pallas", "xla"], choices=["pallas", "xla"])
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  mesh = tpu_mesh(a.topology)
  print(f"# {a.topology}: {mesh.devices.flat[0].device_kind}, jax {jax.__version__}",
        file=sys.stderr)
  for T in a.T:
    for packing in a.packing:
      for mode in a.modes:
        rows = {}
        for impl in a.impls:
          rows[impl] = compile_one(mesh, impl, mode, T, packing == "packed")
          rows[impl]["topology"] = a.topology
          emit(rows[impl], a.out)
        if len(rows) == 2:
          pl_, xla = rows["pallas"], rows["xla"]
          emit(dict(ratio="pallas/xla", topology=a.topology, mode=mode, T=T, packing=packing,
                    temp=round(pl_["temp_bytes"] / max(xla["temp_bytes"], 1), 3),
                    optimal_seconds=round(pl_["optimal_seconds"] / xla["optimal_seconds"], 3),
                    bytes_accessed=round(pl_["bytes_accessed"] / xla["bytes_accessed"], 3)),
               a.out)


if __name__ == "__main__":
  main()
