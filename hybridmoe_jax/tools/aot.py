"""Ahead-of-time compilation of a run's real steps for a TPU topology or GPU node, on any machine.

`run_train.py --dry_run --config.hardware.topology=v5p-256` calls `aot_report`: each stage's
train step (the run's TrainState with `parallel.rules` shardings, the EP MoE and context runner
of `parallel.runtime`), the prefill chunk and the decode step are lowered with abstract
arguments and compiled by libtpu for the slice's devices (`parallel.topology`); under
`jax.set_mesh` of that mesh the implementation choosers (`ops.platform`) pick the TPU's.

Per program: the compiler's figures ("compiler estimate": `memory_analysis()` per device, the
cost model's time), our memory model's figure (train) and the ratio, compile time, tokens/s and
MFU against the chip's peak (`hardware.CHIPS`). `layers=(a, b)` compiles a and b layers (same
pattern) and extrapolates linearly per layer: compile time grows with depth.

GPUs ('h100:8', 'h200:2x8'): compiled by XLA:GPU from the CUDA plugin for the target config's
device (`parallel.topology.gpu_topology_devices`). Deviceless GPU executables have no cost
analysis (UNIMPLEMENTED) and XLA's HLO cost analysis counts nothing inside the Triton calls,
so step time and MFU come from our own count (`step_seconds`: a roofline of 6 / 2 x active x
tokens plus every mixer's FLOPs, and the compiler's argument + output bytes).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.infer import steps
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.cache import init_cache
from hybridmoe_jax.model.count import active_from_breakdown, param_breakdown
from hybridmoe_jax.model.stack import layer_split
from hybridmoe_jax.model.impls import describe_impls
from hybridmoe_jax.ops.attention import api as attention
from hybridmoe_jax.ops.kda import choose as kda_choose
from hybridmoe_jax.ops.kda.chunked import forward_flops
from hybridmoe_jax.ops.plan import LOCAL, ExecutionPlan, execution_plan
from hybridmoe_jax.parallel import runtime as runtime_lib
from hybridmoe_jax.parallel import topology
from hybridmoe_jax.parallel.ep_moe import ExpertParallelDispatch
from hybridmoe_jax.parallel.exchange import resolve_impl_why
from hybridmoe_jax.parallel.mesh import batch_sharding, build_mesh, mesh_shape
from hybridmoe_jax.parallel.rules import tree_shardings
from hybridmoe_jax.config.hardware import CHIPS, GPU_TARGETS
from hybridmoe_jax.config.run import RunConfig
from hybridmoe_jax.config.sharding import TOKEN_AXES
from hybridmoe_jax.train import dry_run as dry_lib
from hybridmoe_jax.train import optim
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.train.state import abstract_train_state
from hybridmoe_jax.train.step import make_train_step

MOSAIC_CALL = "tpu_custom_call"   # the custom call a Pallas TPU (Mosaic) kernel compiles to
TRITON_CALL = "__gpu$xla.gpu.triton"  # ... and a Pallas GPU (Triton) kernel, in XLA:GPU's HLO


@dataclasses.dataclass
class Compiled:
  """One program compiled for the topology: the compiler's figures per device."""

  name: str                 # "train stage 0 T=4,096", "prefill P=2,048", "decode"
  tokens: int               # tokens one call processes (global)
  compile_s: float
  memory: dict[str, float]  # arguments, outputs, aliased, temporaries, code, total (bytes)
  cost: dict[str, float]    # the cost model's optimal_seconds, flops, bytes accessed
  hlo: str = ""             # the compiled HLO text (tests read it; not printed)
  model_bytes: float | None = None  # our memory model's figure (train steps)
  model_flops: float | None = None  # 6 x active x tokens (train) / 2 x active x tokens
  extra_flops: float = 0.0  # our count of the mixers' FLOPs the cost model misses (train)


def _memory(compiled) -> dict[str, float]:
  m = compiled.memory_analysis()
  out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
         "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
         "code": m.generated_code_size_in_bytes}
  # Donated inputs share their buffers with outputs: counted once.
  out["total"] = (out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
                  + out["code"])
  return out


def _cost(compiled) -> dict[str, float]:
  """The cost model's figures per device: optimal_seconds (absent or <= 0 when XLA's TPU
  cost model cannot time the program), flops, bytes accessed; {} where the compiler has no
  cost analysis (deviceless GPU executables: UNIMPLEMENTED)."""
  try:
    cost = compiled.cost_analysis()
  except jax.errors.JaxRuntimeError as e:
    if "UNIMPLEMENTED" not in str(e):
      raise
    return {}
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return {k: float(cost[k]) for k in ("optimal_seconds", "flops", "bytes accessed")
          if (cost or {}).get(k) is not None}


def step_seconds(c: "Compiled", chip: str) -> tuple[float | None, str]:
  """-> (seconds per call, how): the cost model's optimal_seconds, else the roofline of its
  FLOPs and bytes on the chip (max(flops / peak, bytes / HBM bandwidth)); either plus
  `extra_flops` at peak. GPUs (no cost model): "our roofline", max((model_flops +
  extra_flops) / peak, (arguments + outputs) / HBM bandwidth), a lower bound on the time
  (every weight and state byte moved once, every FLOP at peak)."""
  spec, plus = CHIPS.get(chip), " + our count" if c.extra_flops else ""
  if spec is None:
    return None, "n/a"
  if chip in GPU_TARGETS and not c.cost:
    if c.model_flops is None:
      return None, "n/a"
    moved = c.memory.get("arguments", 0.0) + c.memory.get("outputs", 0.0)
    return (max((c.model_flops + c.extra_flops) / spec.peak_bf16_flops,
                moved / spec.hbm_bytes_per_s), "our roofline")
  extra = c.extra_flops / spec.peak_bf16_flops
  if c.cost.get("optimal_seconds", 0) > 0:
    return c.cost["optimal_seconds"] + extra, "cost model" + plus
  if "flops" in c.cost:
    return (max((c.cost["flops"] + c.extra_flops) / spec.peak_bf16_flops,
                c.cost.get("bytes accessed", 0.0) / spec.hbm_bytes_per_s), "roofline" + plus)
  return None, "n/a"


def uncounted_flops(run: RunConfig, plan: ExecutionPlan, seq_len: int, rows: int,
                    every_mixer: bool = False) -> float:
  """Global FLOPs of a train step's mixers that XLA's cost model misses (splash has no cost
  estimate; a loop body, blockwise or the chunked KDA scan, is counted once), by our count:
  causal attention T^2 x heads x (qk + v dims) per row forward, 3.5 forwards with the
  backward (KDA: 3, DESIGN s1.3b), one more under remat. `every_mixer` (GPUs: no cost model
  at all): every attention and KDA layer whatever its implementation (the Pallas KDA kernel
  counted as the chunked form's FLOPs). Call under the program's mesh."""
  m, kd, cp, kinds = run.model.mla, run.model.kda, run.compute, run.model.layer_kinds
  remat = float(cp.remat != "none")
  attn, _ = attention.choose(
      cp.mla_impl, plan=plan, backend=attention.current_backend()[0],
      seq_len=seq_len, block=cp.mla_block, head_dim=m.qk_head_dim, v_head_dim=m.v_head_dim,
      dtype=cp.dtype, has_segments=True)
  dims = (2 * m.kv_lora_rank + m.qk_rope_head_dim if attn == "context"  # absorbed
          else m.qk_head_dim + m.v_head_dim)
  counted = attn != "dense" or every_mixer
  total = counted * kinds.count("mla") * rows * seq_len ** 2 * m.num_heads * dims
  total *= 3.5 + remat
  lb = kd.lower_bound if kd.gate == "bounded" else None
  core = lambda p: kda_choose(cp.kda_impl, head_dim=kd.head_dim, v_head_dim=kd.v_head_dim,
                              chunk_size=cp.kda_chunk_size, lower_bound=lb, tokens=seq_len,
                              plan=p)[0]
  kda_core = core(plan) if core(plan) != "context" else core(LOCAL)  # a shard's own pass
  if kda_core == "chunked" or every_mixer:
    total += (3 + remat) * kinds.count("kda") * forward_flops(
        rows * seq_len, kd.num_v_heads, kd.head_dim, kd.v_head_dim, cp.kda_chunk_size)
  return float(total)


def _compile(name: str, fn, args, kwargs, mesh, tokens: int,
             where: ExecutionPlan | None = None) -> Compiled:
  """fn lowered and compiled under `mesh` and the execution plan `where`."""
  t0 = time.perf_counter()
  with jax.set_mesh(mesh), execution_plan(where):
    lowered = fn.lower(*args, **kwargs)
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      # The compiler refuses a program over HBM: a row that says by how much, not a crash.
      found = _HBM_REFUSAL.search(str(e))
      if not found:
        raise
      temps = float(found.group(1)) * 2 ** 30
      memory = {"arguments": 0.0, "outputs": 0.0, "aliased": 0.0, "temporaries": temps,
                "code": 0.0, "total": temps}
      return Compiled(name=f"{name} [refused: compiler's temporaries alone exceed HBM]",
                      tokens=tokens, compile_s=time.perf_counter() - t0, memory=memory,
                      cost={})
  return Compiled(name=name, tokens=tokens, compile_s=time.perf_counter() - t0,
                  memory=_memory(compiled), cost=_cost(compiled),
                  hlo=compiled.as_text() or "")


# libtpu's refusal: "... required for HLO temporaries (795.09G) exceeds available HBM ..."
_HBM_REFUSAL = re.compile(r"HLO temporaries \(([0-9.]+)G\) exceeds available HBM")


def _structs(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      tree, shardings)


def _with_layers(run: RunConfig, layers: int) -> RunConfig:
  """The run with its model cut to `layers` layers of the same pattern (the preset's
  layer_kinds cut, or the default pattern of that depth)."""
  cfg = run.model
  kinds = cfg.layer_kinds[:layers] if layers < len(cfg.layer_kinds) else cfg.layer_kinds
  if "mla" not in kinds and "mla" in cfg.layer_kinds:
    kinds = kinds[:-1] + ("mla",)  # keep one of each mixer so both are compiled
  moe = dataclasses.replace(cfg.moe, first_dense_layers=min(cfg.moe.first_dense_layers,
                                                            layers - 1))
  model = dataclasses.replace(cfg, num_layers=layers, layer_kinds=kinds, moe=moe)
  return dataclasses.replace(run, model=model)


def select_stages(plan: plan_lib.Plan, text: str) -> tuple[plan_lib.StagePlan, ...]:
  """--aot_stages 'A,B' (stage indices or names, e.g. '0,1m') -> those stages of the plan in
  plan order; '' -> every stage. A curriculum's stages compile one at a time this way (a
  1M-token stage alone takes long on a small host)."""
  if not text:
    return plan.stages
  by_key = {str(s.index): s for s in plan.stages} | {s.name: s for s in plan.stages}
  wanted = [k.strip() for k in text.split(",")]
  unknown = [k for k in wanted if k not in by_key]
  if unknown:
    allowed = ", ".join(f"{s.index} or {s.name!r}" for s in plan.stages)
    raise ConfigError(f"--aot_stages={text!r} is invalid: allowed stage indices or names "
                      f"({allowed}), comma-separated")
  picked = {by_key[k].index for k in wanted}
  return tuple(s for s in plan.stages if s.index in picked)


def train_programs(run: RunConfig, devices, plan: plan_lib.Plan,
                   stages: tuple[plan_lib.StagePlan, ...], cost: bool = True
                   ) -> list[Compiled]:
  """The train step of each of `stages` (`select_stages`), compiled for `devices` with the
  run's mesh. XLA costs a loop body once: the microbatch loop (grad_accum) and the layer
  scan (compute.scan_layers, compiled at scan_unroll 1) are costed from extra compiles
  with unrolled bodies (`_loop_corrected`). `cost=False`: one compile per step, memory
  only (no step time: the unrolled compiles take most of a flagship's compile time)."""
  t = run.train
  out = []
  tx = optim.make_optimizer(t, plan.schedule())
  for s in stages:
    rt = _train_runtime(run, s, devices)
    # scan_unroll 1: the layer scan's costing (`_layer_scan_loop`) starts from one copy.
    graphdef, abstract = abstract_train_state(
        run.model, dataclasses.replace(run.compute, scan_unroll=1), tx, t.seed)
    shardings = tree_shardings(abstract, rt.mesh)
    step = lambda unroll, gdef=graphdef: make_train_step(
        gdef, run.model, tx, grad_accum=t.grad_accum, schedule=plan.schedule(),
        state_shardings=shardings, plan=rt.plan, accum_unroll=unroll)
    tokens = jax.ShapeDtypeStruct((s.batch_size, s.seq_len), jnp.int32,
                                  sharding=batch_sharding(rt.mesh, sequence=True,
                                                          rows=s.batch_size))
    args = (_structs(abstract, shardings), {"tokens": tokens, "segment_ids": tokens})
    name = f"train stage {s.index} T={s.seq_len:,}"
    c = _compile(name, step(1), args, {}, rt.mesh, s.batch_size * s.seq_len)
    if not cost:
      c.cost, c.extra_flops = {}, 0.0
      out.append(c)
      continue
    loops = []  # (body copies the compile missed, unroll u, the compile with u copies)
    ga = t.grad_accum
    if ga > 1 and c.cost:  # the loop body is costed once: cost it from u unrolled copies
      u = _smallest_divisor(ga)
      loops.append((ga - 1, u, _compile(name, step(u), args, {}, rt.mesh, c.tokens)))
    loops += _layer_scan_loop(run, tx, name, step, args, rt.mesh, c)
    if loops:
      c.cost = _loop_corrected(c.cost, loops)
      c.compile_s += sum(cu.compile_s for _, _, cu in loops)
    out.append(c)
  return out


def _smallest_divisor(n: int) -> int:
  """The smallest d >= 2 dividing n (n >= 2): an unroll that leaves no remainder."""
  return min(d for d in range(2, n + 1) if n % d == 0)


def _layer_scan_loop(run: RunConfig, tx, name: str, step, args, mesh, c: Compiled) -> list:
  """With compute.scan_layers, the layer scan (R repeats, `model.stack`) is costed once per
  microbatch: compile it with u repeats per iteration too (-> [(grad_accum x (R - 1), u,
  compiled)], see `_loop_corrected`). `c` must be compiled with scan_unroll 1 and
  accumulation unroll 1; the scan runs inside the accumulation loop, so each of the
  grad_accum microbatches misses R - 1 repeats (the accumulation correction adds whole
  microbatches whose scan counts once, like `c`'s)."""
  repeats = layer_split(run.model).repeats if run.compute.scan_layers else 0
  if repeats < 2 or not c.cost:
    return []
  u = _smallest_divisor(repeats)
  compute = dataclasses.replace(run.compute, scan_unroll=u)
  graphdef, _ = abstract_train_state(run.model, compute, tx, run.train.seed)
  return [(run.train.grad_accum * (repeats - 1), u,
           _compile(name, step(1, graphdef), args, {}, mesh, c.tokens))]


def _loop_corrected(cost: dict[str, float], loops) -> dict[str, float]:
  """The cost of a program whose loops XLA's cost_analysis counted once: for each loop
  (extra, u, compiled with u body copies per iteration), one body costs
  (compiled - cost) / (u - 1), and `extra` more bodies are added. Figures missing or <= 0 in
  any compile are left out."""
  return {k: v + sum(extra * (cu.cost[k] - v) / (u - 1) for extra, u, cu in loops)
          for k, v in cost.items() if v > 0 and all(cu.cost.get(k, 0) > 0 for *_, cu in loops)}


def _train_runtime(run: RunConfig, s: plan_lib.StagePlan, devices) -> runtime_lib.Runtime:
  """The train step's runtime for stage `s` on `devices` (its mesh and execution plan)."""
  return runtime_lib.setup(dataclasses.asdict(run.mesh), run.model, run.compute,
                           batch_size=s.batch_size, grad_accum=run.train.grad_accum,
                           seq_len=s.seq_len, devices=devices)


def _fixed_mesh(run: RunConfig, n: int):
  """The run's mesh section with its -1 resolved against `n` devices."""
  return dataclasses.replace(run.mesh, **mesh_shape(run.mesh.axis_sizes(), n))


def _serve_plan(run: RunConfig, mesh) -> ExecutionPlan:
  """The serving programs' plan: expert-parallel MoE on a multi-device mesh ("ragged")."""
  return ExecutionPlan(moe_dispatch=(
      ExpertParallelDispatch(mesh, capacity_factor=run.compute.moe_capacity_factor)
      if run.compute.moe_impl == "ragged" and mesh.size > 1 else None))


def _mesh(run: RunConfig, devices):
  return build_mesh(run.mesh.axis_sizes(), devices)


def serve_programs(run: RunConfig, devices, *, max_len: int, prefill_chunk: int,
                   kv_block: int = 512) -> list[Compiled]:
  """A prefill chunk and a decode step (`infer.steps`'s jitted functions) for one row per
  token shard (data x fsdp x expert), parameters sharded for serving, the cache's rows
  over the batch axes. Whole sequences per device (no context runner)."""
  mesh = _mesh(run, devices)
  rows = math.prod(mesh.shape[a] for a in TOKEN_AXES)
  where = _serve_plan(run, mesh)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridLM(
      run.model, rngs=nnx.Rngs(0), compute=run.compute)))
  state_sh = tree_shardings(state, mesh, serving=True)
  cache = jax.eval_shape(lambda: init_cache(run.model, rows, max_len, dtype=run.compute.dtype))
  rows_sh = NamedSharding(mesh, P(TOKEN_AXES))
  cache_sh = jax.tree.map(lambda a: rows_sh if a.ndim else NamedSharding(mesh, P()), cache)
  state_s, cache_s = _structs(state, state_sh), _structs(cache, cache_sh)
  tok = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows_sh)
  prefill = _compile(f"prefill P={prefill_chunk:,} N={max_len:,}", steps._prefill_chunk,
                     (graphdef, state_s, tok((rows, prefill_chunk)), None, cache_s,
                      tok((rows,))), {"kv_block": kv_block}, mesh, rows * prefill_chunk,
                     where)
  decode = _compile(f"decode B={rows} N={max_len:,}", steps._decode_step,
                    (graphdef, state_s, tok((rows,)), cache_s), {"kv_block": kv_block}, mesh,
                    rows, where)
  return [prefill, decode]


def _extrapolate(small: Compiled, big: Compiled, la: int, lb: int, full: int) -> Compiled:
  """Per-layer linear extrapolation of two compiles (la < lb layers) to `full` layers."""
  f = (full - la) / (lb - la)
  lin = lambda a, b: {k: a[k] + (b[k] - a[k]) * f for k in a if k in b}
  return dataclasses.replace(big, memory=lin(small.memory, big.memory),
                             cost=lin(small.cost, big.cost),
                             compile_s=small.compile_s + big.compile_s, hlo="")


def compile_run(run: RunConfig, *, layers: tuple[int, int] | None = None, serve: bool = True,
                max_len: int | None = None, prefill_chunk: int = 2048,
                stages: str = "", cost: bool = True) -> dict:
  """Compile the run's programs for `hardware.topology`; -> {"programs": [Compiled],
  "devices": n, "chip": key, "impls": [lines], "extrapolated": layers or None}.

  `stages` ('' = all; see `select_stages`) picks the train steps compiled; `serve=False`
  leaves out the prefill and decode programs; `cost=False` compiles each train step once
  and reports its memory only (`train_programs`).

  Raises ConfigError (bad topology / mesh) or topology.TopologyUnavailable (no libtpu).
  """
  if not isinstance(run, RunConfig):
    raise TypeError(f"compile_run takes a RunConfig, got {type(run).__name__}")
  if not run.hardware.topology:
    raise ValueError("compile_run needs hardware.topology (e.g. 'v5p:2x2x1')")
  n = run.model.num_layers
  if layers is not None and not 1 <= layers[0] < layers[1] <= n:
    raise ConfigError(f"--aot_layers={layers[0]},{layers[1]} is invalid: allowed 'A,B', two "
                      f"layer counts 1 <= A < B <= model.num_layers={n}")
  devices = topology.topology_devices(run.hardware.topology)
  plan = plan_lib.build_plan(run)
  picked = select_stages(plan, stages)
  max_len = max_len or max(s.seq_len for s in plan.stages)
  prefill_chunk = min(prefill_chunk, max_len)

  def programs(r: RunConfig) -> list[Compiled]:
    out = train_programs(r, devices, plan, picked, cost)
    if serve:
      out += serve_programs(r, devices, max_len=max_len, prefill_chunk=prefill_chunk)
    return out

  if layers is None:
    progs = programs(run)
  else:
    la, lb = layers
    small, big = programs(_with_layers(run, la)), programs(_with_layers(run, lb))
    full = run.model.num_layers
    progs = [_extrapolate(a, b, la, lb, full) for a, b in zip(small, big)]
  # Our figures at full depth (cheap): memory model, model FLOPs, the FLOPs XLA misses.
  for p, full_p in zip(progs, train_programs_model_only(run, devices, plan, picked)):
    p.model_bytes, p.model_flops, p.extra_flops = full_p
  active = active_from_breakdown(run.model, param_breakdown(run.model))
  for p in progs[len(picked):]:  # prefill, decode: 2 x the full model's active
    p.model_flops = 2.0 * active * p.tokens / len(devices)
  mesh = _mesh(run, devices)
  rt = _train_runtime(run, picked[0], devices)
  with jax.set_mesh(rt.mesh):  # the train step's plan (context runner) differs from serving's
    impls = [f"train: {line}" for line in describe_impls(run.model, run.compute, plan=rt.plan)]
  with jax.set_mesh(mesh):
    impls += [f"serve: {line}" for line in describe_impls(run.model, run.compute,
                                                          plan=_serve_plan(run, mesh))]
    impls.append("MoE exchange: %s (%s)" % resolve_impl_why("auto"))
  return {"programs": progs, "devices": len(devices), "chip": run.hardware.chip,
          "impls": impls, "extrapolated": layers, "run": run, "mesh": dict(mesh.shape)}


def train_programs_model_only(run: RunConfig, devices, plan,
                              stages) -> list[tuple[float, float, float]]:
  """(our memory model's bytes, model FLOPs, `uncounted_flops`) per device of each of
  `stages`' train step."""
  e = dry_lib.estimate(dataclasses.replace(run, mesh=_fixed_mesh(run, len(devices))), plan)
  out = []
  for s in stages:
    comps = dry_lib.stage_memory(run, e, s.seq_len, s.batch_size)[run.compute.remat]
    rt = _train_runtime(run, s, devices)
    with jax.set_mesh(rt.mesh):
      missed = uncounted_flops(run, rt.plan, s.seq_len, s.batch_size,
                               every_mixer=run.hardware.chip in GPU_TARGETS)
    out.append((dry_lib.step_bytes(comps),
                6.0 * e["active"] * s.batch_size * s.seq_len / len(devices),
                missed / len(devices)))
  return out


def parse_layers(text: str) -> tuple[int, int] | None:
  """--aot_layers 'A,B' -> (A, B) with 1 <= A < B; '' -> None (the model's own depth)."""
  if not text:
    return None
  try:
    layers = tuple(int(v) for v in text.split(","))
  except ValueError:
    layers = ()
  if len(layers) != 2 or not 1 <= layers[0] < layers[1]:
    raise ConfigError(f"--aot_layers={text!r} is invalid: allowed 'A,B', two layer counts "
                      "1 <= A < B (compiled, then extrapolated per layer)")
  return layers
