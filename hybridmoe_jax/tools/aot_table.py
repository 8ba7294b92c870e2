"""The AOT report: `tools/aot.compile_run`'s programs as one table (every figure per device,
COMPILER ESTIMATES), and `aot_report`, which compiles and prints it (`--dry_run` on a
topology, `tools/footprint`)."""

from __future__ import annotations

from hybridmoe_jax.config.hardware import CHIPS, GPU_TARGETS
from hybridmoe_jax.config.run import RunConfig
from hybridmoe_jax.tools.aot import TRITON_CALL, compile_run, step_seconds
from hybridmoe_jax.train import dry_run as dry_lib
from hybridmoe_jax.train.dry_run import GiB


def _ms(secs: float) -> str:
  """Milliseconds, 2 decimals; below 0.01 ms (a tiny model's roofline) 3 significant digits."""
  ms = secs * 1e3
  return f"{ms:,.2f}" if ms >= 0.01 else f"{ms:.3g}"


def _gib(b: float) -> str:
  return f"{b / GiB:,.2f}"


def report(result: dict) -> str:
  """The AOT table: one row per program, every figure per device; compiler estimates."""
  run, chip = result["run"], result["chip"]
  spec = CHIPS[chip]
  usable = run.hardware.usable_bytes
  mesh = " x ".join(f"{a}={n}" for a, n in result["mesh"].items())
  layers = result["extrapolated"]
  gpu = chip in GPU_TARGETS
  source = ("XLA:GPU from the CUDA plugin: memory analysis only; deviceless GPU executables "
            "have no cost analysis, so step ms and MFU are OUR ESTIMATE, a roofline of our "
            "FLOP count and the compiler's argument + output bytes" if gpu
            else "libtpu: XLA's memory analysis and cost model")
  head = (f"AOT compile for {run.hardware.topology}: {result['devices']} x {chip} "
          f"({spec.memory_gib:.0f} GiB HBM, {spec.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16 "
          f"peak), mesh {mesh}. Figures per device are COMPILER ESTIMATES ({source}), not "
          f"measurements.")
  if layers:
    head += (f" Compiled with {layers[0]} and {layers[1]} layers, extrapolated linearly per "
             f"layer to {run.model.num_layers}; compile time is the two compiles'.")
  # One unit for the table: GiB, or MiB when every program's total is below 1 GiB.
  unit, div = (("GiB", GiB) if max(p.memory["total"] for p in result["programs"]) >= GiB
               else ("MiB", 2 ** 20))
  size = lambda b: f"{b / div:,.2f}"
  rows = []
  for p in result["programs"]:
    secs, how = step_seconds(p, chip)
    model = "-" if p.model_bytes is None else size(p.model_bytes)
    ratio = "-" if p.model_bytes is None else f"{p.model_bytes / p.memory['total']:.2f}"
    tps = "-" if not secs else f"{p.tokens / secs:,.0f}"
    mfu = "-" if not secs or p.model_flops is None else \
        f"{100 * p.model_flops / (secs * spec.peak_bf16_flops):.1f}%"
    fits = "yes" if p.memory["total"] <= usable else \
        f"NO, {_gib(p.memory['total'] - usable)} GiB over"
    rows.append([p.name, size(p.memory["arguments"]), size(p.memory["outputs"]),
                 size(p.memory["temporaries"]), size(p.memory["total"]),
                 f"{100 * p.memory['total'] / (spec.memory_gib * GiB):.0f}%", fits, model,
                 ratio, f"{p.compile_s:.0f}", "-" if not secs else f"{_ms(secs)} ({how})",
                 tps, mfu])
  header = ["program", f"args {unit}", f"out {unit}", f"temp {unit}", f"total {unit}",
            "of HBM", f"fits {_gib(usable)} GiB usable", f"model {unit}", "model/XLA",
            "compile s",
            "step ms", "tokens/s", "MFU"]
  if gpu:
    head += " Pallas kernels compiled to Triton calls: " + ", ".join(
        f"{p.name.split(' ')[0]} {p.hlo.count(TRITON_CALL)}" for p in result["programs"]
        if p.hlo) + "."
  notes = ("  total = arguments + outputs - donated (aliased) + temporaries + code; model: "
           "our memory model (train.dry_run) for the train step; step ms: the cost model's "
           "optimal_seconds, or the roofline of its FLOPs and bytes (grad_accum's loop costed "
           "from an unrolled compile; + our count: the attention / KDA FLOPs it misses, "
           "uncounted_flops; GPUs: our roofline, see above); MFU: 6 (train) or 2 "
           "(serve) x active parameters x tokens over step time x peak.")
  return "\n".join([head, "implementations (chosen for the target):"]
                   + [f"  {line}" for line in result["impls"]]
                   + [dry_lib.format_table(header, rows), notes])


def aot_report(run: RunConfig, **kwargs) -> dict:
  """Compile (`compile_run`), print the table; -> compile_run's result with "fits": every
  program's compiler total within the usable memory."""
  result = compile_run(run, **kwargs)
  print(report(result), flush=True)
  usable = result["run"].hardware.usable_bytes
  result["fits"] = [p.memory["total"] <= usable for p in result["programs"]]
  return result
