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
pallas / xla for temp bytes and optimal_seconds (< 1: the kernel wins). The XLA path's
flops, bytes and optimal_seconds count every step of its chunk scan (`xla_scan_costs`); the
program's own figures, which count the loop body once, are kept as `*_loop_once`.
These are compiler estimates, not measurements: no TPU ran anything.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from hybridmoe_jax.ops.kda.chunked import _group_step, kda_chunked, scan_steps, step_tokens
from hybridmoe_jax.parallel.topology import topology_devices
from benchmarks._timing import stopwatch
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


def kda_fn(impl: str):
  def run(q, k, v, g, beta, seg=None):
    kw = dict(segment_ids=seg, chunk_size=C, lower_bound=LB)
    if impl == "pallas":
      return kda_pallas(q, k, v, g, beta, backend="tpu", interpret=False, **kw)[0]
    return kda_chunked(q, k, v, g, beta, **kw)[0]

  return run


def program(impl: str, mode: str):
  run = kda_fn(impl)
  if mode == "fwd":
    return run

  def fwdbwd(q, k, v, g, beta, *seg):
    loss = lambda *x: jnp.sum(run(*x, *seg).astype(jnp.float32))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

  return fwdbwd


_COSTS = (("flops", "flops"), ("bytes_accessed", "bytes accessed"),
          ("transcendentals", "transcendentals"), ("optimal_seconds", "optimal_seconds"))


def _costs(compiled) -> dict[str, float]:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return {k: float(cost.get(name, -1)) for k, name in _COSTS}


def xla_scan_costs(mesh: Mesh, mode: str, T: int, packed: bool) -> dict[str, float]:
  """The XLA path's cost with every step of its chunk scan counted.

  XLA's cost analysis counts a loop body once, and charges a loop's dynamic slices of the
  stacked inputs at their whole size, so neither the program's figure nor an unrolled
  compile's difference is the real cost. One scan step (`ops.kda.chunked._group_step`, the
  scan's body) is compiled alone on its own [B, G*C, ...] inputs instead: fwd = steps x that
  step; fwd+bwd = steps x (the step + the step's vjp, which recomputes it: the scan body is
  checkpointed). Reshapes outside the scan (free for B = 1) are not counted.
  """
  gc, steps = step_tokens(T, C), scan_steps(T, C)
  sd = jax.ShapeDtypeStruct
  state = sd((B, H, K, V), jnp.float32)
  # One step's inputs: the program's arguments at gc tokens, plus the segment entering it.
  xs = arg_specs(gc, packed)
  xs += [sd((B,), jnp.int32)] if packed else [None, None]
  step = lambda s, x: _group_step(s, x, c=C, scale=K ** -0.5, lower_bound=LB)  # noqa: E731

  def vjp(s, x, ds, do):
    return jax.vjp(step, s, x)[1]((ds, do))

  rep = NamedSharding(mesh, PartitionSpec())
  progs = [(jax.jit(step), (state, tuple(xs)))]
  if mode == "fwdbwd":
    progs.append((jax.jit(vjp), (state, tuple(xs), state, sd((B, gc, H, V), jnp.float32))))
  total = dict.fromkeys(dict(_COSTS), 0.0)
  with jax.set_mesh(mesh):
    for fn, args in progs:
      args = jax.tree.map(lambda a: sd(a.shape, a.dtype, sharding=rep), args)
      for key, value in _costs(fn.lower(*args).compile()).items():
        # -1: the compiler gave no figure (kept as -1, not multiplied).
        total[key] = -1.0 if value < 0 or total[key] < 0 else total[key] + steps * value
  return total


def compile_one(mesh: Mesh, impl: str, mode: str, T: int, packed: bool) -> dict:
  specs = arg_specs(T, packed)
  rep = NamedSharding(mesh, PartitionSpec())
  with stopwatch() as sw, jax.set_mesh(mesh):
    fn = jax.jit(program(impl, mode), in_shardings=(rep,) * len(specs))
    compiled = fn.lower(*specs).compile()
  seconds = sw.seconds
  mem = compiled.memory_analysis()
  cost = _costs(compiled)
  row = dict(
      impl=impl, mode=mode, T=T, packing="packed" if packed else "unpacked",
      temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes),
      output_bytes=int(mem.output_size_in_bytes), **cost,
      mosaic_calls=compiled.as_text().count('custom_call_target="tpu_custom_call"'),
      compile_s=round(seconds, 1))
  if impl == "xla":  # the program's own figures count the scan body once: keep them aside
    row.update({f"{k}_loop_once": v for k, v in cost.items()},
               **xla_scan_costs(mesh, mode, T, packed), scan_costed=True)
  return row


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
