"""MaxText anchor: MaxText 0.2.5's deepseek2-16b train step compiled deviceless for a TPU
v5p-64 slice (32 chips), costed with the same estimator as our AOT table
(`hybridmoe_jax/tools/aot.py`), so that our own AOT figures have an outside reference.

What it compiles (MaxText's own train_compile machinery, `maxtext.trainers.pre_train.
train_compile`: `get_topology_mesh`, `get_shaped_inputs`, `get_functional_train_with_signature`
of `train.train_step`, `jit_and_compile`; its `main` only prints the analyses and writes a
serialized file, so this script runs the same steps and keeps the compiled object):

  MaxText options (everything else is MaxText's base.yml default: remat_policy='full',
  weight_dtype float32, dtype bfloat16, opt_type adamw, sparse_matmul + megablox, dropless,
  attention 'autoselected'):
    model_name=deepseek2-16b override_model_config=true compile_topology=v5p-64
    compile_topology_num_slices=1 scan_layers=false per_device_batch_size=1
    max_target_length=4096 base_num_decoder_layers=<2|4> run_name=maxtext_anchor
    base_output_directory=/tmp/maxtext_anchor_output (no file is written for a compile)
  layouts:
    fsdp4_ep8: ici_fsdp_parallelism=4 ici_expert_parallelism=8
    fsdp32:    ici_fsdp_parallelism=32
    fsdp4_ep8_rbf1.25: fsdp4_ep8 + ragged_buffer_factor=1.25 (ours: compute.
               moe_capacity_factor=1.25): receive buffers 1.25 x the balanced rows
  deepseek2-16b keeps first_num_dense_layers=1: 2 layers = 1 dense + 1 MoE, 4 = 1 + 3.

scan_layers=false because XLA's cost_analysis counts a loop body once. Each (layout, depth)
compiles in its own child process (one at a time; memory is returned between compiles); the
two depths are extrapolated linearly per layer to deepseek2-16b's 27 layers exactly as
`tools/aot.py::_extrapolate` does, and timed with `tools/aot.py::step_seconds` (the cost
model's optimal_seconds if > 0, else the roofline max(flops / peak, bytes / HBM bandwidth))
on `hardware.CHIPS["tpu_v5p"]`. Memory per device = arguments + outputs - aliased +
temporaries + generated code. MFU = 6 x active params x tokens / (step s x devices x peak).
Active params follow our published convention (`hybridmoe_jax/model/count.py`): every weight
a token uses except the input embedding (the LM head counts), routed experts at k/E.

Where it runs: in our venv (`. .venv/bin/activate`) after
    pip install --no-deps maxtext==0.2.5
    pip install --no-deps omegaconf antlr4-python3-runtime==4.9.3 pathwaysutils qwix aqtp \\
        tokamax immutabledict xprof fire termcolor six jaxtyping wadler_lindig einshape \\
        drjax sympy mpmath
(MaxText 0.2.5 only asks jax>=0.11.1, flax>=0.12.9, libtpu>=0.0.46: our pins satisfy it),
so MaxText's programs and ours are compiled by one libtpu and costed by one estimator.

    nice -n 10 python benchmarks/maxtext_anchor.py                 # every layout, 2 and 4 layers
    nice -n 10 python benchmarks/maxtext_anchor.py --layouts fsdp32 --layers 2,4

Notes from the first run (jax 0.12.0, libtpu 0.0.50.1, 2 CPU cores): each compile takes
3-6 min (2 / 4 layers), ~3 GB host RAM; a full 27-layer fsdp32 compile (--layers 27) took
25 min, 12 GB RSS, and matched the 2,4 extrapolation within 1% (48.40 vs 48.92 GiB, 487 vs
482 ms; generated code does not grow per layer, so its extrapolated figure is high). With
expert parallelism MaxText's default ragged_buffer_factor=-1 sizes the ragged all-to-all
receive buffer for the worst case (min(EP, E/k) = 8 x the balanced tokens), and the megablox
gmm's Pallas CostEstimate is 2 x m x k x n of that static buffer: the cost model charges the
routed experts 8x their FLOPs, so fsdp4_ep8's step time is pessimistic (its memory is real).

Writes one JSON line per layout to benchmarks/results/maxtext_anchor.jsonl (replacing the
lines of the layouts run) and prints a markdown table. Without MaxText it prints how to
install it and "SKIPPED: ..." and exits 0. Standalone: not imported by the package or tests.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridmoe_jax.config.hardware import CHIPS, HardwareConfig  # noqa: E402
from hybridmoe_jax.tools import aot  # noqa: E402
from benchmarks._timing import now  # noqa: E402
from benchmarks.deepseek_params import CONFIG_KEYS, _tree_params, count_params  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "maxtext_anchor.jsonl"
GiB = 2 ** 30
MAXTEXT_VERSION = "0.2.5"
TOPOLOGY, DEVICES, CHIP = "v5p-64", 32, "tpu_v5p"
MODEL, FULL_LAYERS = "deepseek2-16b", 27
COMMON = ["model_name=deepseek2-16b", "override_model_config=true",
          f"compile_topology={TOPOLOGY}", "compile_topology_num_slices=1", "scan_layers=false",
          "per_device_batch_size=1", "max_target_length=4096", "run_name=maxtext_anchor",
          "base_output_directory=/tmp/maxtext_anchor_output"]  # nothing is written there
LAYOUTS = {"fsdp4_ep8": ["ici_fsdp_parallelism=4", "ici_expert_parallelism=8"],
           "fsdp32": ["ici_fsdp_parallelism=32"],
           # Expert parallelism with receive buffers of 1.25 x the balanced rows on both
           # sides (MaxText's ragged_buffer_factor, our compute.moe_capacity_factor):
           # routed work is costed at 1.25x, not the dropless worst case of 8x.
           "fsdp4_ep8_rbf1.25": ["ici_fsdp_parallelism=4", "ici_expert_parallelism=8",
                                 "ragged_buffer_factor=1.25"]}
TOKENS_PER_DEVICE = 4096
INSTALL = ("pip install --no-deps maxtext==0.2.5 && pip install --no-deps omegaconf "
           "antlr4-python3-runtime==4.9.3 pathwaysutils qwix aqtp tokamax immutabledict xprof "
           "fire termcolor six jaxtyping wadler_lindig einshape drjax sympy mpmath  "
           "(in a Python 3.12 venv with jax/jaxlib/libtpu >= 0.11.1/0.11.1/0.0.46 and flax "
           ">= 0.12.9, e.g. this project's .venv)")
CHILD_TAG = "MAXTEXT_ANCHOR_CHILD "
# MaxText's programs are read, extrapolated and timed by our AOT tool's own functions.
ESTIMATOR = "hybridmoe_jax.tools.aot (_memory, _cost, _extrapolate, step_seconds)"


# ---------------------------------------------------------------- the child: one compile

def child(layout: str, layers: int) -> None:
  """Compile MaxText's train step for `layout` at `layers` decoder layers; print one JSON
  line (tagged CHILD_TAG) with the compiler's memory and cost figures."""
  # libtpu on a host without a TPU (as hybridmoe_jax/parallel/topology.py sets them).
  for k, v in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
               ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_ACCELERATOR_TYPE", "v5p-8")):
    os.environ.setdefault(k, v)
  # As train_compile.main does before it parses the config.
  os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "")
                                    + " --xla_tpu_spmd_rng_bit_generator_unsafe=true")
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_default_prng_impl", "unsafe_rbg")
  from flax.core.spmd import logical_axis_rules as axis_rules  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train, train_compile as tc  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, sharding  # pylint: disable=import-outside-toplevel

  base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
  argv = ["train_compile", base_yml, *COMMON, *LAYOUTS[layout],
          f"base_num_decoder_layers={layers}"]
  t_start = now()
  config = pyconfig.initialize(argv)
  tc.validate_config(config)
  mesh = tc.get_topology_mesh(config)
  shaped_args, shaped_kwargs, state_shardings, _, model = tc.get_shaped_inputs(mesh, config)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
      config, state_shardings)
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(
      config, state_shardings, params_shardings)
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  fn, in_shard, out_shard, static_argnums, donate_argnums = \
      maxtext_utils.get_functional_train_with_signature(
          train.train_step, data_sharding, input_shardings, model, config, params_shardings)
  t0 = now()
  compiled = tc.jit_and_compile(fn, shaped_args, shaped_kwargs, mesh, in_shard, out_shard,
                                static_argnums, donate_argnums, config,
                                axis_rules(config.logical_axis_rules))
  compile_s = now() - t0
  memory, cost = aot._memory(compiled), aot._cost(compiled)  # the same reading as ours
  cfg = {k: getattr(config, k) for k in CONFIG_KEYS if hasattr(config, k)}
  cfg["mesh_axes"] = list(cfg.get("mesh_axes", []))
  # MaxText's own MFU FLOPs at full depth (cross-check only): its config at 27 layers.
  full = pyconfig.initialize(argv[:-1] + [f"base_num_decoder_layers={FULL_LAYERS}"])
  mt_total, mt_weights, mt_attn = maxtext_utils.calculate_tflops_training_per_device(
      full, log=False)
  full_cfg = {k: getattr(full, k) for k in CONFIG_KEYS if hasattr(full, k)}
  full_cfg["mesh_axes"] = list(full_cfg.get("mesh_axes", []))
  out = {"layout": layout, "layers": layers, "compile_s": compile_s,
         "setup_s": t0 - t_start, "memory": memory, "cost": cost,
         "mesh": {a: int(n) for a, n in mesh.shape.items() if int(n) > 1},
         "devices": int(mesh.devices.size), "config": cfg, "full_config": full_cfg,
         "tree_params": _tree_params(shaped_args[0], int(config.num_experts)),
         "maxtext_tflops_per_device": {"total": mt_total, "weights": mt_weights,
                                       "attention": mt_attn}}
  print(CHILD_TAG + json.dumps(out, default=str), flush=True)


# ---------------------------------------------------------------- the parent

# ---------------------------------------------------------------- ours, same layouts

OURS_MESH = {"fsdp4_ep8": {"fsdp": 4, "expert": 8}, "fsdp32": {"fsdp": 32, "expert": 1},
             "fsdp4_ep8_rbf1.25": {"fsdp": 4, "expert": 8}}
OURS_COMPUTE = {"fsdp4_ep8_rbf1.25": {"moe_capacity_factor": 1.25}}


def ours_child(layout: str, layers: int, config: str) -> None:
  """Our preset's train step for the layout (batch 32 x 4,096 = 4,096 tokens per device,
  grad_accum 1, remat full) through tools/aot.compile_run at `layers` layers; one JSON line
  with the compiled figures and our full-depth model FLOPs / missed mixer FLOPs."""
  from hybridmoe_jax.config.flags import load_config_file  # pylint: disable=import-outside-toplevel
  from hybridmoe_jax.config.run import run_config_from_dict  # pylint: disable=import-outside-toplevel
  cfg = load_config_file(str(REPO / config))
  cfg.hardware.topology = TOPOLOGY
  for axis, n in OURS_MESH[layout].items():
    setattr(cfg.mesh, axis, n)
  for key, value in OURS_COMPUTE.get(layout, {}).items():
    setattr(cfg.compute, key, value)
  cfg.train.batch_size, cfg.train.grad_accum = DEVICES, 1
  cfg.train.seq_len, cfg.compute.remat = TOKENS_PER_DEVICE, "full"
  run = run_config_from_dict(cfg)
  full = run.model.num_layers
  result = aot.compile_run(aot._with_layers(run, layers) if layers < full else run,
                           serve=False)
  c = result["programs"][0]
  # Our figures at the preset's full depth (compile_run gave the cut model's).
  (c.model_bytes, c.model_flops, c.extra_flops), = aot.train_programs_model_only(
      run, aot.topology.topology_devices(TOPOLOGY), aot.plan_lib.build_plan(run),
      aot.plan_lib.build_plan(run).stages)
  print(CHILD_TAG + json.dumps({"layers": layers, "compile_s": c.compile_s, "memory": c.memory,
                                "cost": c.cost, "model_bytes": c.model_bytes,
                                "model_flops": c.model_flops, "extra_flops": c.extra_flops,
                                "full_layers": full, "impls": result["impls"]}), flush=True)


def ours_row(layout: str, config: str, depths: list[int], timeout: float) -> dict:
  """Our preset compiled like MaxText's anchor (same slice, tokens per device, estimator),
  each depth in its own process, extrapolated per layer to the preset's depth."""
  runs = []
  for n in depths:
    cmd = [sys.executable, os.path.abspath(__file__), "--_ours", layout, str(n), config]
    print(f"[maxtext_anchor] compiling ours ({config}) {layout} at {n} layers", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(CHILD_TAG)]
    if proc.returncode != 0 or not lines:
      tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-40:])
      raise RuntimeError(f"our compile {layout} x {n} layers failed:\n{tail}")
    runs.append(json.loads(lines[-1][len(CHILD_TAG):]))
  full = runs[-1]["full_layers"]
  mk = lambda r: aot.Compiled(name=f"ours {layout}", tokens=TOKENS_PER_DEVICE * DEVICES,
                              compile_s=r["compile_s"], memory=r["memory"], cost=r["cost"],
                              model_bytes=r["model_bytes"], model_flops=r["model_flops"],
                              extra_flops=r["extra_flops"])
  c = (aot._extrapolate(mk(runs[0]), mk(runs[1]), depths[0], depths[1], full)
       if len(runs) == 2 else mk(runs[0]))
  secs, how = aot.step_seconds(c, CHIP)
  peak = CHIPS[CHIP].peak_bf16_flops
  return {"layout": layout, "program": f"ours {config}", "layers_compiled": depths,
          "layers_full": full, "memory_gib_per_device": {k: v / GiB for k, v in c.memory.items()},
          "model_gib": c.model_bytes / GiB, "step_seconds": secs, "step_how": how,
          "tokens_per_second": c.tokens / secs if secs else None,
          "mfu": c.model_flops / (secs * peak) if secs else None,
          "compile_seconds": c.compile_s, "impls": runs[-1]["impls"]}


def _versions() -> dict:
  out = {}
  for name in ("jax", "jaxlib", "libtpu", "maxtext", "flax"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _run_child(layout: str, layers: int, timeout: float) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--_child", layout, str(layers)]
  print(f"[maxtext_anchor] compiling {layout} at {layers} layers: {' '.join(cmd)}", flush=True)
  t0 = now()
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(CHILD_TAG)]
  if proc.returncode != 0 or not lines:
    tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-40:])
    raise RuntimeError(f"compile {layout} x {layers} layers failed (rc {proc.returncode}):\n{tail}")
  out = json.loads(lines[-1][len(CHILD_TAG):])
  out["child_wall_s"] = now() - t0
  print(f"[maxtext_anchor]   compile {out['compile_s']:.0f} s (setup {out['setup_s']:.0f} s, "
        f"process {out['child_wall_s']:.0f} s), total "
        f"{out['memory']['total'] / GiB:.2f} GiB/device, cost {out['cost']}", flush=True)
  return out


def _row(layout: str, runs: list[dict], active: int, versions: dict) -> dict:
  chip = CHIPS[CHIP]
  peak = chip.peak_bf16_flops
  tokens = TOKENS_PER_DEVICE * DEVICES
  comps = [aot.Compiled(name=f"maxtext {layout}", tokens=tokens, compile_s=r["compile_s"],
                    memory={k: float(v) for k, v in r["memory"].items()},
                    cost=dict(r["cost"])) for r in runs]
  layers = [r["layers"] for r in runs]
  if len(comps) == 2:
    c = aot._extrapolate(comps[0], comps[1], layers[0], layers[1], FULL_LAYERS)
  else:
    c = comps[0]
  secs, how = aot.step_seconds(c, CHIP)
  mfu = 6.0 * active * tokens / (secs * DEVICES * peak) if secs else None
  mt = runs[-1]["maxtext_tflops_per_device"]
  mt_mfu = mt["total"] * 1e12 / (secs * peak) if secs else None
  mem = {k: c.memory[k] / GiB for k in ("arguments", "outputs", "aliased", "temporaries",
                                        "code", "total")}
  return {
      "layout": layout, "maxtext_options": COMMON + LAYOUTS[layout],
      "mesh": runs[-1]["mesh"], "topology": TOPOLOGY, "devices": DEVICES, "chip": CHIP,
      "layers_compiled": layers, "layers_full": FULL_LAYERS,
      "extrapolated": len(comps) == 2,
      "memory_gib_per_device": mem,
      "flops_per_device": c.cost.get("flops"),
      "bytes_accessed_per_device": c.cost.get("bytes accessed"),
      "optimal_seconds": c.cost.get("optimal_seconds"),
      "step_seconds": secs, "step_how": how, "estimator": ESTIMATOR,
      "tokens_per_step": tokens, "tokens_per_second": tokens / secs if secs else None,
      "active_params": active, "mfu": mfu,
      "maxtext_mfu_crosscheck": mt_mfu,
      "maxtext_tflops_per_device": mt["total"],
      "compile_seconds": c.compile_s,
      "compile_seconds_each": {str(r["layers"]): round(r["compile_s"], 1) for r in runs},
      "per_compile": [{"layers": r["layers"],
                       "memory_gib": {k: v / GiB for k, v in r["memory"].items()},
                       "cost": r["cost"], "tree_params": r["tree_params"]} for r in runs],
      "versions": versions, "python": sys.version.split()[0],
      "chip_figures": {"memory_gib": chip.memory_gib, "peak_bf16_flops": peak,
                       "hbm_bytes_per_s": chip.hbm_bytes_per_s},
  }


def markdown(rows: list[dict]) -> str:
  """The AOT table's columns (tools/aot.py report); model / model-XLA: '-' (no model here)."""
  memory_gib = CHIPS[CHIP].memory_gib
  usable = HardwareConfig(topology=TOPOLOGY).usable_bytes
  head = ["program", "args GiB", "out GiB", "temp GiB", "total GiB", "of HBM",
          f"fits {usable / GiB:,.2f} GiB usable", "model GiB", "model/XLA", "compile s",
          "step ms", "tokens/s", "MFU"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    m = r["memory_gib_per_device"]
    over = m["total"] * GiB - usable
    fits = "yes" if over <= 0 else f"NO, {over / GiB:,.2f} GiB over"
    step = "-" if not r["step_seconds"] else \
        f"{r['step_seconds'] * 1e3:,.2f} ({r['step_how']})"
    tps = "-" if not r["tokens_per_second"] else f"{r['tokens_per_second']:,.0f}"
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    name = (f"MaxText {MODEL} train {r['layout']} ({' x '.join(f'{a}={n}' for a, n in r['mesh'].items())})"
            f" T={TOKENS_PER_DEVICE:,}")
    lines.append("| " + " | ".join([
        name, f"{m['arguments']:,.2f}", f"{m['outputs']:,.2f}", f"{m['temporaries']:,.2f}",
        f"{m['total']:,.2f}", f"{100 * m['total'] / memory_gib:.0f}%", fits, "-", "-",
        f"{r['compile_seconds']:.0f}", step, tps, mfu]) + " |")
  return "\n".join(lines)


def _write(rows: list[dict]) -> None:
  """Replace the lines of the layouts run in RESULTS; keep the others."""
  RESULTS.parent.mkdir(parents=True, exist_ok=True)
  kept = []
  if RESULTS.exists():
    key = lambda r: (r.get("program", "maxtext"), r.get("layout"))
    done = {key(r) for r in rows}
    for line in RESULTS.read_text().splitlines():
      try:
        if key(json.loads(line)) not in done:
          kept.append(line)
      except json.JSONDecodeError:
        continue
  RESULTS.write_text("".join(l + "\n" for l in kept + [json.dumps(r) for r in rows]))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--layouts", default=",".join(LAYOUTS),
                  help=f"comma-separated, of {sorted(LAYOUTS)} (default: all)")
  ap.add_argument("--layers", default="2,4",
                  help="'A,B' (compiled, extrapolated per layer to 27) or one depth "
                       "(27 = no extrapolation); default 2,4")
  ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per compile")
  ap.add_argument("--no_write", action="store_true", help="do not write the results file")
  ap.add_argument("--ours", default="",
                  help="also compile this preset of ours (e.g. configs/kimi_linear_48b.py) in "
                       "the same layouts and run: batch 32 x 4,096, grad_accum 1, remat full, "
                       "at the same --layers, extrapolated to its own depth")
  ap.add_argument("--_child", nargs=2, metavar=("LAYOUT", "LAYERS"), help=argparse.SUPPRESS)
  ap.add_argument("--_ours", nargs=3, metavar=("LAYOUT", "LAYERS", "CONFIG"),
                  help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args._child:
    child(args._child[0], int(args._child[1]))
    return 0
  if args._ours:
    ours_child(args._ours[0], int(args._ours[1]), args._ours[2])
    return 0

  if importlib.util.find_spec("maxtext") is None:
    print(f"MaxText {MAXTEXT_VERSION} is not importable in {sys.executable}. Install it "
          f"beside the project:\n  {INSTALL}")
    print("SKIPPED: maxtext not installed (benchmarks/maxtext_anchor.py)")
    return 0
  if importlib.util.find_spec("libtpu") is None:
    print("libtpu (the TPU compiler) is not installed: pip install \"jax[tpu]==<jax version>\"")
    print("SKIPPED: libtpu not installed (benchmarks/maxtext_anchor.py)")
    return 0
  layouts = [l for l in args.layouts.split(",") if l]
  bad = [l for l in layouts if l not in LAYOUTS]
  if bad or not layouts:
    ap.error(f"--layouts={args.layouts!r}: allowed a comma-separated subset of {sorted(LAYOUTS)}")
  try:
    depths = [int(v) for v in args.layers.split(",")]
  except ValueError:
    depths = []
  if not (len(depths) == 2 and 2 <= depths[0] < depths[1]) and \
      not (len(depths) == 1 and depths[0] >= 2):
    ap.error(f"--layers={args.layers!r}: allowed 'A,B' with 2 <= A < B, or one depth >= 2 "
             "(first_num_dense_layers=1: each depth needs a MoE layer)")

  versions = _versions()
  print(f"[maxtext_anchor] versions {versions}; estimator: {ESTIMATOR}", flush=True)
  rows = []
  for layout in layouts:
    runs = [_run_child(layout, n, args.timeout) for n in depths]
    full_cfg = runs[-1]["full_config"]
    params = count_params(full_cfg)
    # The compiled trees check the formula at their own depth.
    for r in runs:
      at = count_params(r["config"])
      ok = at["total"] == r["tree_params"]["total"] and \
          at["routed_experts"] == r["tree_params"]["routed_experts"]
      print(f"[maxtext_anchor]   {r['layers']} layers: formula total {at['total']:,} routed "
            f"{at['routed_experts']:,} vs MaxText's abstract params {r['tree_params']['total']:,}"
            f" routed {r['tree_params']['routed_experts']:,}: {'match' if ok else 'MISMATCH'}")
    if len(depths) == 1 and depths[0] != FULL_LAYERS:
      print(f"[maxtext_anchor]   NOTE: one depth ({depths[0]}) compiled, not extrapolated to "
            f"{FULL_LAYERS}: figures are those of {depths[0]} layers; MFU uses 27-layer params")
    row = _row(layout, runs, params["active"], versions)
    row["params"] = {k: v for k, v in params.items()}
    rows.append(row)
    print(json.dumps(row), flush=True)
  p = rows[0]["params"]
  print(f"\nActive parameters ({MODEL}, {FULL_LAYERS} layers, first_num_dense_layers "
        f"{full_cfg['first_num_dense_layers']}): "
        f"{p['formula']}.\n  total {p['total']:,}; input embedding {p['input_embedding']:,} "
        f"(excluded, our convention), LM head {p['lm_head']:,}; routed experts "
        f"{p['routed_experts']:,} of which active (k/E = {full_cfg['num_experts_per_tok']}/"
        f"{full_cfg['num_experts']}) {p['routed_active']:,}; active {p['active']:,} "
        f"({p['active_with_input_embedding']:,} with the input embedding).")
  print(f"MFU = 6 x {p['active']:,} x {TOKENS_PER_DEVICE * DEVICES:,} tokens / (step s x "
        f"{DEVICES} x peak); cross-check: MaxText's calculate_tflops_training_per_device "
        f"(its FLOPs incl. causal attention) = {rows[0]['maxtext_tflops_per_device']:.1f} "
        "TFLOP/device/step -> " + ", ".join(
            f"{r['layout']} {100 * r['maxtext_mfu_crosscheck']:.1f}%" for r in rows
            if r["maxtext_mfu_crosscheck"]) + "\n")
  print(f"AOT compile of MaxText {versions['maxtext']} {MODEL} for {TOPOLOGY}: {DEVICES} x "
        f"{CHIP}; compiled with {' and '.join(map(str, depths))} layers"
        + (f", extrapolated linearly per layer to {FULL_LAYERS}" if len(depths) == 2 else "")
        + "; compile s is the compiles'. COMPILER ESTIMATES, not measurements.\n")
  print(markdown(rows))
  for layout in (layouts if args.ours else []):
    r = ours_row(layout, args.ours, depths, args.timeout)
    print(json.dumps(r), flush=True)
    m = r["memory_gib_per_device"]
    print(f"| ours {args.ours} {layout} | {m['arguments']:,.2f} | {m['outputs']:,.2f} | "
          f"{m['temporaries']:,.2f} | {m['total']:,.2f} | model {r['model_gib']:,.2f} | "
          f"{r['compile_seconds']:.0f} | {r['step_seconds'] * 1e3:,.2f} ({r['step_how']}) | "
          f"{r['tokens_per_second']:,.0f} | {100 * r['mfu']:.1f}% |", flush=True)
    rows.append(r)
  if not args.no_write:
    _write(rows)
    print(f"\nwrote {RESULTS.relative_to(REPO)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
