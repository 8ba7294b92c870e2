"""`--dry_run`: parameter counts and per-device parameter + optimizer memory, nothing allocated.

With a context curriculum (`config.curriculum.stages`) it also prints the stage plan. For
every stage (a plain run is one) it prints the per-device memory of one training step by
component (`stage_memory`: params, gradients, their running sum under grad_accum, ZeRO-3's
gathered weight, optimizer, activations under the remat
policy, KDA scan states, gathered MLA latents, attention scores / workspace, logits) against
the target device (`hardware`: device, memory, margin), and whether it fits.
`benchmarks/memory_model.py` checks the model against XLA's own count
(`compiled.memory_analysis()`) and BENCHMARKS.md keeps the ratios.

Everything comes from abstract shapes (`nnx.eval_shape` / `jax.eval_shape`). Per-device
parameter and optimizer bytes lay each leaf out by the sharding rules themselves
(`parallel.rules`: the train step's own shardings), replicated over data.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from hybridmoe_jax.model.count import active_from_breakdown, param_breakdown, param_pieces
from hybridmoe_jax.model.stack import layer_split
from hybridmoe_jax.ops.cross_entropy import VOCAB_BLOCK
from hybridmoe_jax.ops.kda.chunked import scan_steps
from hybridmoe_jax.ops.attention.api import memory_core
from hybridmoe_jax.parallel.ep_moe import buffer_rows
from hybridmoe_jax.parallel.mesh import mesh_shape
from hybridmoe_jax.config.hardware import parse_topology
from hybridmoe_jax.config.run import MeshConfig, RunConfig
from hybridmoe_jax.config.sharding import MESH_AXES, path_string, spec_for
from hybridmoe_jax.parallel import rules
from hybridmoe_jax.train import memory_model, optim
from hybridmoe_jax.train import stage_plan as plan_lib

GiB = 1024 ** 3


def _bytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def resolve_mesh(mesh: MeshConfig, devices: int | None = None) -> dict[str, int]:
  """-1 takes `devices` (a target topology's chips; default the local devices); without
  -1 the configured sizes define the device count."""
  sizes = [getattr(mesh, a) for a in MESH_AXES]
  if devices is not None:
    return mesh_shape(mesh.axis_sizes(), devices)
  if -1 in sizes:
    return mesh_shape(mesh.axis_sizes(),
                      max(jax.device_count(), math.prod(v for v in sizes if v != -1)))
  return mesh_shape(mesh.axis_sizes(), math.prod(sizes))


def estimate(run: RunConfig, plan: plan_lib.Plan) -> dict:
  """Counts and per-device bytes for `run` (model, train.optimizer, mesh)."""
  cfg = run.model
  mesh = resolve_mesh(run.mesh, parse_topology(run.hardware.topology)[2]
                      if run.hardware.topology else None)
  counts = param_breakdown(cfg)
  total, active = sum(counts.values()), active_from_breakdown(cfg, counts)
  tx = optim.make_optimizer(run.train, plan.schedule())
  param_bytes = opt_bytes = dev_param_bytes = dev_opt_bytes = dev_scanned_bytes = 0
  scanned = set(layer_split(cfg).scanned) if run.compute.scan_layers else set()
  variants = {index: [index, *rest] for index, *rest in cfg.layer_variants().values()}
  for index, params, times in param_pieces(cfg, vision=True):
    opt = jax.eval_shape(tx.init, params)
    dev = _device_bytes(params, mesh)
    param_bytes += times * _bytes(params)
    opt_bytes += times * _bytes(opt)
    dev_param_bytes += times * dev
    dev_opt_bytes += times * _device_bytes(opt, mesh)
    if index is not None:
      dev_scanned_bytes += dev * sum(i in scanned for i in variants[index])
  return {
      "total": total, "active": active, "mesh": mesh,
      "devices": math.prod(mesh.values()), "param_bytes": param_bytes,
      "opt_bytes": opt_bytes, "per_device_param_bytes": dev_param_bytes,
      "per_device_opt_bytes": dev_opt_bytes,
      "per_device_scanned_param_bytes": dev_scanned_bytes,
      "per_param_split": dev_param_bytes / max(param_bytes, 1),
      "optimizer": run.train.optimizer,
  }


def _device_bytes(tree, mesh: dict[str, int]) -> float:
  """Bytes of `tree` on one device when each leaf is laid out by the sharding rules
  (`parallel.rules.logical_names` + `spec_for`, what the train step's shardings use): a dim
  the mesh axes do not divide stays whole, as it does on the devices."""
  total = 0.0
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = tuple(getattr(leaf, "shape", ()))
    spec = spec_for(rules.logical_names(path_string(path), len(shape)), shape, mesh)
    split = math.prod(mesh[a] for dim in spec if dim is not None
                      for a in ((dim,) if isinstance(dim, str) else dim))
    total += math.prod(shape) * leaf.dtype.itemsize / split
  return total


def _fmt_bytes(b: float) -> str:
  return f"{b / GiB:,.2f} GiB" if b >= GiB else f"{b / 2 ** 20:,.2f} MiB"


def _fmt_count(n: int) -> str:
  return f"{n:,} ({n / 1e9:.3f}B)" if n >= 1e8 else f"{n:,} ({n / 1e6:.3f}M)"


def report(e: dict) -> str:
  mesh = " x ".join(f"{a}={e['mesh'][a]}" for a in MESH_AXES)
  dev_total = e["per_device_param_bytes"] + e["per_device_opt_bytes"]
  return "\n".join([
      f"parameters: total {_fmt_count(e['total'])}, active {_fmt_count(e['active'])}",
      f"mesh: {mesh} ({e['devices']} device(s))",
      f"whole model: params {_fmt_bytes(e['param_bytes'])} (fp32 master), "
      f"{e['optimizer']} state {_fmt_bytes(e['opt_bytes'])}",
      f"per device: params {_fmt_bytes(e['per_device_param_bytes'])} + optimizer "
      f"{_fmt_bytes(e['per_device_opt_bytes'])} = {_fmt_bytes(dev_total)} "
      "(gradients and activations not included)",
  ])


def blockwise_workspace_bytes(cfg, block: int, rows: float) -> float:
  """fp32 [rows, H, block, block] logits, probabilities and their gradient: one MLA layer's
  blockwise attention in flight (the backward's peak), whatever T."""
  return 3.0 * 4 * max(rows, 1.0) * cfg.mla.num_heads * block * block


REMATS = ("none", "dots", "full")


def zero3_gathers(mesh: dict[str, int]) -> bool:
  """Whether the step gathers weights at all: ZeRO-3 splits them over fsdp x context."""
  return mesh["fsdp"] * mesh.get("context", 1) > 1


def gathered_weight_bytes(cfg, mesh: dict[str, int], act_bytes: int) -> float:
  """ZeRO-3's working set: the largest weight gathered whole over fsdp x context in the
  compute dtype, with its fp32 gradient before the reduce-scatter. The larger of the LM
  head ([d, vocab] / tensor) and one MoE layer's local experts (gate, up and down
  [E / expert, width, d_ff] / tensor, one fp32 gradient at a time). 0 when nothing is
  gathered (fsdp x context = 1). libtpu's buffers for Kimi K3: bf16 [56, 3072, 3584] x 3 and
  f32 [7168, 163840] at the peak (BENCHMARKS.md)."""
  if not zero3_gathers(mesh):
    return 0.0
  tensor = mesh["tensor"]
  head = cfg.vocab_size * cfg.d_model * (act_bytes + 4) / tensor
  moe = cfg.moe
  width = moe.latent_dim or cfg.d_model
  local = moe.num_experts / mesh["expert"] * width * moe.expert_intermediate / tensor
  experts = local * (3 * act_bytes + 4) if cfg.num_layers > moe.first_dense_layers else 0.0
  return float(max(head, experts))


def ep_buffer_bytes(cfg, compute, mesh: dict[str, int], tokens: float,
                    act_bytes: int) -> float:
  """Bytes one MoE layer's expert-parallel exchange holds beyond the traced (local, balanced)
  rows: the receive buffer is compiled at R rows (`parallel.ep_moe.buffer_rows`: the worst
  case G a dropless, ceil(c a) with compute.moe_capacity_factor c), a = tokens x k. Per
  extra row, forward and gradient: the received input and the returned output [n], the
  gate and up outputs and the activation [I] each, in the compute dtype. 0 without expert
  parallelism."""
  shards = mesh.get("expert", 1)
  if shards <= 1 or cfg.num_layers <= cfg.moe.first_dense_layers:
    return 0.0
  moe = cfg.moe
  a = max(int(tokens), 1) * moe.experts_per_token
  rows = buffer_rows(a, shards, compute.moe_capacity_factor)
  width = moe.latent_dim or cfg.d_model
  return max(rows - a, 0) * (2 * width + 3 * moe.expert_intermediate) * act_bytes * 2.0


def batch_rows(mesh: dict[str, int], batch_size: int, grad_accum: int = 1) -> float:
  """Sequences of one microbatch per batch shard: batch_size / grad_accum rows over data x
  fsdp (below 1: a sequence's share, split over context), and over expert too where the
  rows divide (as `config.sharding.batch_axes` splits them)."""
  micro = batch_size / grad_accum
  dp, ep = mesh["data"] * mesh["fsdp"], mesh.get("expert", 1)
  return micro / (dp * (ep if micro % (dp * ep) == 0 else 1))


def stage_memory(run: RunConfig, e: dict, seq_len: int, batch_size: int
                 ) -> dict[str, dict[str, float]]:
  """Per-device bytes of one training step, by component, for each remat policy.

  Args:
    run: the run (model, compute, train.grad_accum); e: `estimate(run, plan)`.
    seq_len, batch_size: the stage's sequence length and global batch (sequences).
  Returns:
    {remat: {component: bytes}} with components
      params, gradients (fp32, like the master weights), optimizer: split as `estimate` says;
      gradient_sum: with train.grad_accum > 1, the microbatch loop's fp32 running sum (one
        more gradient set);
      gathered: `gathered_weight_bytes` (ZeRO-3's gathered weight and its gradient);
      scan_weight_copy: with compute.scan_layers and a 16-bit compute dtype, the
        compute-dtype copy of every scanned layer's (fp32, sharded) weights: libtpu hoists
        each layer's cast out of the layer scan and casts the whole stack once, so the copy
        lives through the step (its `convert` of bf16[R, ...] stacks in the entry
        computation; an optimization_barrier in the body does not stop it);
      activations: what the forward keeps for the backward, counted by JAX
        (`memory_model.residual_bytes`: projections, conv outputs, gates, KDA scan states,
        MLA latents, router and expert activations) x the microbatch's tokens here;
      recompute: under "dots" / "full", one layer's residuals while the backward
        recomputes it;
      weight_copies: residuals that do not grow with T (compute-dtype copies of weights),
        sharded like the parameters;
      mla_latents: with mesh.context > 1, each MLA layer's all-gathered latents [T, d_c +
        d_r] of the whole sequence and their gradient (all MLA layers without remat, one
        layer's otherwise); the traced residuals hold only the local shard's;
      attention: the blockwise core's [H, block, block] fp32 workspace in flight (dense:
        already in the activations);
      logits: the loss's fp32 logits of one vocabulary block, their exponentials and
        gradient ([tokens, block] x 3; `ops.cross_entropy`, never the whole vocabulary);
      ep_buffers: with mesh.expert > 1, the expert-parallel receive buffer's rows beyond the
        balanced ones the traced residuals hold (`ep_buffer_bytes`), for the layer being
        recomputed (every MoE layer without remat).
    Rows of a microbatch split over data x fsdp x expert where they divide
    (`batch_rows`); each sequence over mesh.context.
    `kda_states` (fp32 [HV, K, V] per chunked-scan step and KDA layer) is reported as a
    part of activations, not added again.
  """
  cfg, compute = run.model, run.compute
  mesh = e["mesh"]
  context = mesh.get("context", 1)
  # One microbatch's sequences here (as before, at least 1 / grad_accum of the batch's).
  rows_mb = max(batch_rows(mesh, batch_size, run.train.grad_accum), 1.0 / run.train.grad_accum)
  tokens = rows_mb * seq_len / context             # ... and their tokens on this device
  per_tok = memory_model.residual_bytes(cfg, compute, seq_len)
  act_bytes = 2 if compute.dtype in ("bfloat16", "float16") else 4
  n_kda = sum(k == "kda" for k in cfg.layer_kinds)
  n_moe = max(cfg.num_layers - cfg.moe.first_dense_layers, 0)
  n_mla = len(cfg.layer_kinds) - n_kda
  k, m = cfg.kda, cfg.mla
  # The chunked scan keeps one fp32 state per step for the backward.
  kda_one = (rows_mb * scan_steps(math.ceil(seq_len / context), compute.kda_chunk_size)
             * 4.0 * k.num_v_heads * k.head_dim * k.v_head_dim)
  latent_one = (rows_mb * seq_len * (m.kv_lora_rank + m.qk_rope_head_dim) * (act_bytes + 4)
                if context > 1 else 0.0)
  core = memory_core(compute.mla_impl, seq_len, compute.mla_block)
  attention = (blockwise_workspace_bytes(cfg, compute.mla_block, rows_mb)
               if core == "blockwise" and n_mla else 0.0)
  ep_extra = ep_buffer_bytes(cfg, compute, mesh, tokens, act_bytes)
  static = {"params": e["per_device_param_bytes"], "gradients": e["per_device_param_bytes"],
            "optimizer": e["per_device_opt_bytes"],
            "gradient_sum": e["per_device_param_bytes"] if run.train.grad_accum > 1 else 0.0,
            "gathered": gathered_weight_bytes(cfg, mesh, act_bytes),
            "scan_weight_copy": e.get("per_device_scanned_param_bytes", 0.0) * act_bytes / 4
            if act_bytes < 4 and compute.scan_layers else 0.0}
  out = {}
  for p in REMATS:
    kept = n_mla if p == "none" else min(1, n_mla)
    out[p] = dict(static, activations=per_tok[p]["saved"] * tokens,
                  recompute=per_tok[p]["peak"] * tokens,
                  weight_copies=(per_tok[p]["saved_fixed"] + per_tok[p]["peak_fixed"])
                  * e["per_param_split"],
                  mla_latents=latent_one * kept,
                  attention=attention,
                  logits=3.0 * 4 * min(cfg.vocab_size, VOCAB_BLOCK) * tokens,
                  ep_buffers=ep_extra if p != "none" else ep_extra * n_moe)
    out[p]["kda_states"] = kda_one * (n_kda if p == "none" else min(1, n_kda))
  return out


def step_bytes(components: dict[str, float]) -> float:
  """The total of `stage_memory` components (kda_states is a part of activations)."""
  return sum(b for name, b in components.items() if name != "kda_states")


def format_table(header: list[str], rows: list[list[str]], indent: str = "  ") -> str:
  """A plain-text table: the first column left-aligned, the others right-aligned, columns
  separated by two spaces (the dry run's and the AOT report's one format)."""
  cols = list(zip(*([header] + rows)))
  width = [max(len(c) for c in col) for col in cols]
  def line(cells):
    return indent + "  ".join(c.ljust(w) if k == 0 else c.rjust(w)
                              for k, (c, w) in enumerate(zip(cells, width))).rstrip()
  return "\n".join([line(header), indent + "  ".join("-" * w for w in width)]
                   + [line(r) for r in rows])


# Rows of the memory table: (component, label); kda_states is a part of another row.
_COMPONENTS = (("params", "params (fp32 master)"), ("gradients", "gradients"),
               ("optimizer", "optimizer state"), ("gradient_sum", "gradient sum (grad_accum)"),
               ("gathered", "gathered weight + grad"),
               ("scan_weight_copy", "scanned weights, compute-dtype copy"),
               ("activations", "activations (kept)"),
               ("recompute", "recompute (1 layer)"), ("weight_copies", "weight copies"),
               ("mla_latents", "MLA latents (gathered)"), ("attention", "attention workspace"),
               ("logits", "logits + grad"), ("ep_buffers", "EP receive buffers"))


def _kda_parent(remat: str) -> str:
  """Where the KDA scan states are counted: every layer's in the activations without remat,
  else the one layer being recomputed."""
  return "activations" if remat == "none" else "recompute"


def _verdict(run: RunConfig, comps: dict[str, dict[str, float]], rows: float,
             context: int, devices: int) -> str:
  """Fits (with the margin left) or not, and what the other remat policies change, in GiB."""
  usable = run.hardware.usable_bytes
  totals = {p: step_bytes(c) for p, c in comps.items()}
  chosen = run.compute.remat
  if rows * context < 1:
    return (f"does not fit: {rows:.2f} rows per batch shard, the batch cannot be split over "
            f"the devices: needs mesh.context >= {math.ceil(1 / rows)}")
  others = "; ".join(
      f"remat='{p}' {'saves' if totals[p] < totals[chosen] else 'costs'} "
      f"{_fmt_bytes(abs(totals[chosen] - totals[p]))}" for p in REMATS if p != chosen)
  if totals[chosen] <= usable:
    return (f"fits with compute.remat='{chosen}': {_fmt_bytes(totals[chosen])} of "
            f"{_fmt_bytes(usable)} usable, {_fmt_bytes(usable - totals[chosen])} to spare "
            f"({others})")
  short = totals[chosen] - usable
  better = [p for p in REMATS if totals[p] <= usable]
  if better:
    return (f"does not fit with compute.remat='{chosen}' ({_fmt_bytes(totals[chosen])} > "
            f"{_fmt_bytes(usable)} usable, {_fmt_bytes(short)} over); fits with "
            f"compute.remat='{better[0]}' ({_fmt_bytes(totals[better[0]])}, saves "
            f"{_fmt_bytes(totals[chosen] - totals[better[0]])})")
  top = max(((n, b) for n, b in comps["full"].items() if n != "kda_states"),
            key=lambda kv: kv[1])
  head = (f"does not fit even with remat='full' ({_fmt_bytes(totals['full'])} > "
          f"{_fmt_bytes(usable)} usable, {_fmt_bytes(totals['full'] - usable)} over; "
          f"largest: {top[0]} {_fmt_bytes(top[1])})")
  state = sum(comps["full"][n] for n in STATE_COMPONENTS)
  if state > usable:
    # grad_accum and mesh.context shrink only activations: the state needs more devices.
    return head + ": " + state_advice(state, usable, devices)
  return head + ": raise train.grad_accum or mesh.context, or add devices"


# The per-device bytes that only more devices shrink (sharded over fsdp / expert): neither
# grad_accum (a smaller microbatch) nor mesh.context (a shorter sequence piece) changes them.
STATE_COMPONENTS = ("params", "gradients", "optimizer", "gradient_sum", "weight_copies",
                    "scan_weight_copy")


def state_advice(state: float, usable: float, devices: int) -> str:
  """What to do when the model state alone (`state` bytes per device on `devices` devices)
  exceeds `usable`: the slice size that holds it, spread evenly (a lower bound: activations
  and temporaries come on top)."""
  need = math.ceil(state * devices / usable)
  pow2 = 1 << (need - 1).bit_length()
  return (f"the model state alone (params, gradients, optimizer, weight copies: "
          f"{_fmt_bytes(state)} per device on {devices} device(s)) exceeds "
          f"{_fmt_bytes(usable)}; grad_accum and mesh.context do not shrink it: shard it over "
          f"at least {need:,} devices of this size (a slice of {pow2:,}, e.g. mesh.fsdp x "
          "mesh.expert; activations come on top)")


def expert_gather_choice(run: RunConfig, e: dict, plan: plan_lib.Plan) -> str:
  """How often one step gathers the routed experts' weights, and why: ZeRO-3 gathers them
  (over fsdp x context) in every microbatch, so one gather per step means one microbatch
  (train.grad_accum = 1), which these figures say fits or not. '' without routed experts."""
  mesh, ga = e["mesh"], run.train.grad_accum
  if not run.model.moe_layers:
    return ""
  if not zero3_gathers(mesh):
    return ("expert weights: never gathered (mesh.fsdp x mesh.context = 1: each device "
            "holds its experts' shards whole)")
  if ga == 1:
    return "expert weights: gathered once per step (train.grad_accum = 1: one microbatch)"
  one = dataclasses.replace(run, train=dataclasses.replace(run.train, grad_accum=1))
  totals = [step_bytes(stage_memory(one, e, s.seq_len, s.batch_size)[run.compute.remat])
            for s in plan.stages]
  usable, worst = run.hardware.usable_bytes, max(totals)
  verdict = (f"fits ({_fmt_bytes(worst)} of {_fmt_bytes(usable)})" if worst <= usable else
             f"does not fit ({_fmt_bytes(worst)} > {_fmt_bytes(usable)}: the whole batch's "
             "activations at once)")
  return (f"expert weights: gathered in each of the {ga} microbatches (train.grad_accum = "
          f"{ga}); one gather per step needs train.grad_accum = 1, which by this model "
          + verdict)


def _core_label(impl: str, core: str) -> str:
  """The MLA core a stage's memory is counted with: a kernel is counted as blockwise."""
  return core if impl in ("auto", core) else f"{impl}, counted as {core}"


def memory_report(run: RunConfig, plan: plan_lib.Plan, e: dict) -> str:
  """Per device: a table of bytes by component (rows) per stage (columns) under
  compute.remat, the totals under every remat policy, then one verdict line per stage."""
  mesh = e["mesh"]
  context = mesh.get("context", 1)
  remat = run.compute.remat
  comps, cores, rows_of = [], [], []
  for s in plan.stages:
    comps.append(stage_memory(run, e, s.seq_len, s.batch_size))
    cores.append(memory_core(run.compute.mla_impl, s.seq_len, run.compute.mla_block))
    rows_of.append(batch_rows(mesh, s.batch_size))
  # One unit for the whole table: GiB, or MiB when every total is below 1 GiB.
  unit, div = ("GiB", GiB) if max(step_bytes(c[p]) for c in comps for p in REMATS) >= GiB \
      else ("MiB", 2 ** 20)
  header = [f"per device, {unit}"] + [f"stage {s.index} ({s.name})" for s in plan.stages]
  gib = lambda b: f"{b / div:,.2f}"
  table = [["sequence length"] + [f"{s.seq_len:,}" for s in plan.stages],
           ["rows per batch shard"] + [f"{r:g}" for r in rows_of]]
  for name, label in _COMPONENTS:
    table.append([label] + [gib(c[remat][name]) for c in comps])
    if name == _kda_parent(remat):
      table.append(["  of which KDA states"] + [gib(c[remat]["kda_states"])
                                                       for c in comps])
  for p in REMATS:
    mark = " (configured)" if p == remat else ""
    table.append([f"total, remat='{p}'{mark}"] + [gib(step_bytes(c[p])) for c in comps])
  lines = [f"memory per device, per stage (target: {run.hardware.describe()}; "
           f"usable {_fmt_bytes(run.hardware.usable_bytes)}; components under "
           f"compute.remat='{remat}'):", format_table(header, table)]
  for s, c, core, rows in zip(plan.stages, comps, cores, rows_of):
    lines.append(f"  stage {s.index} T={s.seq_len:,}: {rows:g} rows/batch shard, context "
                 f"{context}, MLA attention ({_core_label(run.compute.mla_impl, core)}) | "
                 + _verdict(run, c, rows, context, math.prod(mesh.values())))
  gather = expert_gather_choice(run, e, plan)
  if gather:
    lines.append("  " + gather)
  return "\n".join(lines)


def fits(run: RunConfig, plan: plan_lib.Plan, e: dict) -> list[bool]:
  """Per stage: can the batch be split over the devices, and does the step fit the target
  device under the configured remat?"""
  split = e["mesh"]["data"] * e["mesh"]["fsdp"]
  context = e["mesh"].get("context", 1)
  return [s.batch_size * context >= split
          and step_bytes(stage_memory(run, e, s.seq_len, s.batch_size)[run.compute.remat])
          <= run.hardware.usable_bytes for s in plan.stages]


def dry_run(run: RunConfig) -> dict:
  """Print the report (and the curriculum plan when there is one); return the estimate."""
  plan = plan_lib.build_plan(run)
  e = estimate(run, plan)
  print(report(e), flush=True)
  if plan.curriculum:
    print(plan_lib.describe(plan), flush=True)
  print(memory_report(run, plan, e), flush=True)
  e["fits"] = fits(run, plan, e)
  return e
