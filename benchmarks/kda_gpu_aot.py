"""KDA on an H100 / H200 by the compiler's own reports: the Pallas (Triton) GPU kernels compiled
ahead of time on a CPU-only machine (deviceless XLA:GPU from jax's CUDA plugin, ptxas -v).

Usage:  nice -n 19 python benchmarks/kda_gpu_aot.py [--T 8192 32768 131072]
            [--packing unpacked packed] [--modes fwd fwdbwd] [--gpu h100] [--tpu v5p:2x2x1]
            [--config block_v=32,num_warps=4] [--out kda_gpu_aot.jsonl] [--fla PYTHON]
Needs the CUDA plugin (`pip install -e ".[gpu]"`); the TPU reference needs libtpu (`--tpu ''`
leaves it out). Shapes: B=1, H=HV=16, K=V=128, q/k/v/beta bf16, gates fp32 bounded by lb=-5,
chunk 64 (benchmarks/kda_tpu_aot.py's). Packed: segment_ids [B, T] int32 are an argument.

Per (T, packing, mode), one JSON line per KDA kernel launched (prefixed "JSON "): registers,
spill store / load bytes and stack frame (ptxas -v), shared memory, grid, threads, programs,
programs per SM (programs / 132) and programs resident per SM by occupancy
(benchmarks/gpu_kernel_report.py), then one line for the program: the compiler's
temporaries (memory_analysis), XLA's own kernels launched besides the KDA kernels (the glue),
and, for fwdbwd, the TPU kernel's temporaries from libtpu at the same shapes with the ratio
gpu / tpu. The fla anchor (`--fla PYTHON`, default $FLA_PYTHON or ../venv-fla/bin/python
beside this checkout; '' leaves it out): flash-linear-attention's Triton chunk_kda compiled
by Triton itself for sm_90 at the same shapes (benchmarks/fla_anchor_gpu_aot.py, run by that
venv's python: fla needs torch, this project does not), its rows (impl "fla") beside ours
in the same run; one line saying why when that venv or fla is absent. All figures are
COMPILER REPORTS: no GPU ran anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from benchmarks import gpu_kernel_report as gkr  # noqa: E402  (jax-free)

_DUMP = tempfile.mkdtemp(prefix="kda_gpu_aot_")
# Before jax starts: a CPU host describing GPUs, ptxas's report logged, thunks dumped.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {gkr.compiler_flags(_DUMP)}"
os.environ.update(gkr.LOG_ENV)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from benchmarks.kda_tpu_aot import B, C, H, K, LB, V, arg_specs, emit  # noqa: E402,F401
from hybridmoe_jax.parallel.topology import gpu_topology_devices  # noqa: E402
from benchmarks._timing import stopwatch  # noqa: E402
from pallas_kernels.kda import kda_pallas  # noqa: E402
from pallas_kernels.kda.config import default_gpu_config  # noqa: E402


@contextlib.contextmanager
def stderr_to(path: str):
  """fd 2 (where XLA's C++ logging writes) into `path` for the block."""
  sys.stderr.flush()
  saved = os.dup(2)
  with open(path, "w") as f:
    os.dup2(f.fileno(), 2)
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def program(mode: str, config, name: str):
  """The jitted function (named `name`: its dumps are found by it) for `mode`."""
  def run(q, k, v, g, beta, seg=None):
    return kda_pallas(q, k, v, g, beta, segment_ids=seg, chunk_size=C, lower_bound=LB,
                      backend="gpu", interpret=False, config=config)[0]

  def fwdbwd(q, k, v, g, beta, *seg):
    loss = lambda *x: jnp.sum(run(*x, *seg).astype(jnp.float32))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

  fn = run if mode == "fwd" else fwdbwd
  fn.__name__ = fn.__qualname__ = name
  return fn


def compile_gpu(mesh: Mesh, mode: str, T: int, packed: bool, config) -> tuple[dict, list]:
  """-> (the program's row, one row per KDA kernel launch)."""
  packing = "packed" if packed else "unpacked"
  name = f"kda_{mode}_{packing}_{T}"
  specs = arg_specs(T, packed)
  rep = NamedSharding(mesh, PartitionSpec())
  log = os.path.join(_DUMP, f"{name}.log")
  with stopwatch() as sw, stderr_to(log), jax.set_mesh(mesh):
    fn = jax.jit(program(mode, config, name), in_shardings=(rep,) * len(specs))
    compiled = fn.lower(*specs).compile()
  thunks = "".join(open(p).read() for p in
                   glob.glob(os.path.join(_DUMP, f"*jit_{name}.thunk_sequence.txt")))
  ptxas = open(log).read() if os.path.exists(log) else ""
  mem = compiled.memory_analysis()
  launches = gkr.parse_thunks(thunks)
  kernels = gkr.kernel_rows(ptxas, thunks, prefix="kda_")
  row = dict(program=name, gpu=mesh.devices.flat[0].device_kind, mode=mode, T=T,
             packing=packing, temp_bytes=int(mem.temp_size_in_bytes),
             argument_bytes=int(mem.argument_size_in_bytes),
             output_bytes=int(mem.output_size_in_bytes),
             kda_kernels=len(kernels), xla_kernels=len(launches) - len(kernels),
             compile_s=round(sw.seconds, 1), config=dataclasses.asdict(config),
             source="COMPILER REPORT")
  for k in kernels:
    k.update(program=name, mode=mode, T=T, packing=packing)
  return row, kernels


def tpu_temp_bytes(topology: str, T: int, packed: bool) -> int | None:
  """The TPU (Mosaic) kernel's fwd+bwd temporaries at the same shapes (libtpu), or None
  without libtpu."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  if not topology or importlib.util.find_spec("libtpu") is None:
    return None
  from benchmarks import kda_tpu_aot  # pylint: disable=g-import-not-at-top
  row = kda_tpu_aot.compile_one(kda_tpu_aot.tpu_mesh(topology), "pallas", "fwdbwd", T, packed)
  return row["temp_bytes"]


def default_fla_python() -> str:
  return os.environ.get("FLA_PYTHON") or os.path.join(os.path.dirname(_ROOT), "venv-fla",
                                                       "bin", "python")


def start_fla(python: str, a) -> subprocess.Popen | None:
  """fla_anchor_gpu_aot.py under `python` (its own venv), started now, read by finish_fla;
  None (and one line saying why) when that python is absent."""
  if not python:
    return None
  if not os.path.exists(python):
    print(f"# fla anchor skipped: {python} not found (make the venv: "
          "benchmarks/fla_anchor_gpu_aot.py's docstring)", file=sys.stderr)
    return None
  script = os.path.join(_ROOT, "benchmarks", "fla_anchor_gpu_aot.py")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  # Files, not pipes: a full pipe would stall it until our compiles end.
  logs = [open(os.path.join(_DUMP, f"fla.{n}"), "w+") for n in ("out", "err")]
  proc = subprocess.Popen([python, script, "--T", *map(str, a.T), "--packing", *a.packing,
                           "--modes", *a.modes], stdout=logs[0], stderr=logs[1], env=env)
  proc.logs = logs
  return proc


def finish_fla(proc: subprocess.Popen | None, out) -> None:
  """Waits for the fla run; emits its rows, or one line saying why there are none."""
  if proc is None:
    return
  proc.wait()
  stdout, stderr = [(f.seek(0), f.read(), f.close())[1] for f in proc.logs]
  rows = [json.loads(line[5:]) for line in stdout.splitlines() if line.startswith("JSON ")]
  for row in rows:
    emit(row, out)
  if proc.returncode or not rows:
    why = (stderr.strip().splitlines() or ["no output"])[-1]
    print(f"# fla anchor: no rows (exit {proc.returncode}): {why}", file=sys.stderr)


def parse_config(text: str):
  """'block_v=32,num_warps=4' -> the default GpuConfig for K=V=128 bf16 with those fields."""
  cfg = default_gpu_config(chunk_size=C, k=K, v=V, dtype=jnp.bfloat16)
  fields = {f.name: f.type for f in dataclasses.fields(cfg)}
  changes = {}
  for item in filter(None, text.split(",")):
    key, _, value = item.partition("=")
    if key not in fields or key == "chunk_size":
      raise SystemExit(f"--config: {key!r} is not a GpuConfig field (allowed: "
                       f"{', '.join(f for f in fields if f != 'chunk_size')})")
    changes[key] = (value == "True" if value in ("True", "False")
                    else int(value) if value.isdigit() else value)
  return dataclasses.replace(cfg, **changes)


_PTXAS_FIELDS = ("registers", "spill_store_bytes", "spill_load_bytes", "stack_bytes",
                 "resident_per_sm")


def markdown(rows: list[dict]) -> str:
  """The JSON lines of a run as three BENCHMARKS.md tables: per kernel (ours and fla's), per
  program (ours: temporaries vs the TPU kernel's), and ours beside fla's per (T, packing,
  mode): kernels, spill bytes summed, the fewest programs of any launch."""
  ker = ["| impl | T | packing | mode | kernel | registers | spill st/ld B | shared KiB | grid "
         "| programs | per SM | resident/SM |", "|" + "---|" * 12]
  prog = ["| T | packing | mode | temp MiB | TPU temp MiB | GPU/TPU | KDA kernels | XLA kernels "
          "| compile s |", "|" + "---|" * 9]
  mib = lambda b: "-" if b is None else f"{b / 2 ** 20:,.1f}"  # noqa: E731
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    if "kernel" in r:
      impl = r.get("impl", "ours")
      groups.setdefault((r["T"], r["packing"], r["mode"], impl), []).append(r)
      ker.append(f"| {impl} | {r['T']:,} | {r['packing']} | {r['mode']} | `{r['kernel']}` | "
                 f"{r['registers']} | {r['spill_store_bytes']}/{r['spill_load_bytes']} | "
                 f"{r['shared_bytes'] / 1024:.0f} | {r['grid']} | {r['programs']:,} | "
                 f"{r['programs_per_sm']} | {r['resident_per_sm']} |")
    elif "program" in r:
      ratio = r.get("temp_gpu_over_tpu")
      prog.append(f"| {r['T']:,} | {r['packing']} | {r['mode']} | {mib(r['temp_bytes'])} | "
                  f"{mib(r.get('tpu_temp_bytes'))} | {'-' if ratio is None else ratio} | "
                  f"{r['kda_kernels']} | {r['xla_kernels']} | {r['compile_s']} |")
  side = ["| T | packing | mode | impl | kernel launches | spill bytes (st+ld, all) | fewest "
          "programs | max registers | fla saved MiB |", "|" + "---|" * 9]
  for (T, packing, mode, impl), ks in sorted(groups.items()):
    spills = sum((k["spill_store_bytes"] or 0) + (k["spill_load_bytes"] or 0) for k in ks)
    saved = ks[0].get("saved_bytes") if mode == "fwdbwd" else None
    side.append(f"| {T:,} | {packing} | {mode} | {impl} | {len(ks)} | {spills:,} | "
                f"{min(k['programs'] for k in ks):,} | "
                f"{max(k['registers'] or 0 for k in ks)} | {mib(saved)} |")
  return "\n".join(ker + [""] + prog + [""] + side)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
  p.add_argument("--gpu", default="h100", choices=["h100", "h200"])
  p.add_argument("--tpu", default="v5p:2x2x1", help="'' : no TPU reference")
  p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
  p.add_argument("--packing", nargs="+", default=["unpacked", "packed"],
                 choices=["unpacked", "packed"])
  p.add_argument("--config", default="", help="GpuConfig fields, e.g. block_v=32,num_warps=4")
  p.add_argument("--out", default=None)
  p.add_argument("--fla", default=default_fla_python(),
                 help="python of the fla venv ('' : no fla anchor)")
  p.add_argument("--table", default=None, help="print a JSONL file of a run as markdown, "
                 "compile nothing")
  a = p.parse_args(argv)
  if a.table:
    with open(a.table) as f:
      print(markdown([json.loads(line) for line in f if line.strip()]))
    return
  config = parse_config(a.config)
  mesh = Mesh(np.array(gpu_topology_devices(f"{a.gpu}:1")), ("x",))
  print(f"# {mesh.devices.flat[0].device_kind} (deviceless), jax {jax.__version__}, "
        f"{config}; dumps in {_DUMP}", file=sys.stderr)
  fla = start_fla(a.fla, a)   # runs beside our compiles; its rows come after ours
  seen = {}   # (kernel, T, packing) -> its row with ptxas's report
  for T in a.T:
    for packing in a.packing:
      for mode in a.modes:
        row, kernels = compile_gpu(mesh, mode, T, packing == "packed", config)
        for k in kernels:
          key = (k["kernel"], T, packing)
          if k["registers"] is None and key in seen:  # compiled once, reused: that report
            k.update({f: seen[key][f] for f in _PTXAS_FIELDS}, ptxas_from=seen[key]["program"])
          elif k["registers"] is not None:
            seen[key] = k
          emit(k, a.out)
        if mode == "fwdbwd":
          tpu = tpu_temp_bytes(a.tpu, T, packing == "packed")
          row.update(tpu_temp_bytes=tpu, tpu_topology=a.tpu or None,
                     temp_gpu_over_tpu=None if not tpu else round(row["temp_bytes"] / tpu, 3))
        emit(row, a.out)
  finish_fla(fla, a.out)


if __name__ == "__main__":
  main()
