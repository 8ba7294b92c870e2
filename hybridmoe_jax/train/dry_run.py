"""`--dry_run`: parameter counts and per-device parameter + optimizer memory, nothing allocated.

With a context curriculum (`config.curriculum.stages`) it also prints the stage plan and, per
stage, an analytic estimate of the activation memory per device under each remat policy and
the least remat that fits (`activation_bytes_per_token`; an estimate, good to about 2x).

Everything comes from abstract shapes (`nnx.eval_shape` / `jax.eval_shape`). Per-device
memory assumes the usual layout of the planned sharding: dense weights split over
fsdp x tensor, routed experts over expert x fsdp x tensor, replicated over data.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import ml_collections
from flax import nnx

from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.count import active_from_breakdown, param_breakdown
from hybridmoe_jax.model.decoder import DecoderLayer
from hybridmoe_jax.ops.blockwise_attention import resolve_impl as blockwise_resolve
from hybridmoe_jax.parallel.mesh import mesh_shape
from hybridmoe_jax.run_config import MeshConfig, RunConfig, run_config_from_dict
from hybridmoe_jax.sharding import MESH_AXES
from hybridmoe_jax.train import optim
from hybridmoe_jax.train import plan as plan_lib

GiB = 1024 ** 3


def _bytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _param_pieces(cfg):
  """Abstract parameter trees that tile the model, with multiplicities.

  One decoder layer per distinct (mixer kind, dense/MoE) variant plus the parts outside the
  stack (embedding, final norm/mix, head) from a one-layer model: tracing a 93-layer model in
  one eval_shape takes minutes, this takes seconds (as `model.count.param_breakdown` does).
  """
  variants = collections.Counter((k, cfg.is_moe_layer(i)) for i, k in enumerate(cfg.layer_kinds))
  pieces = []
  for (kind, is_moe), times in variants.items():
    index = next(i for i, k in enumerate(cfg.layer_kinds)
                 if k == kind and cfg.is_moe_layer(i) == is_moe)
    layer = nnx.eval_shape(lambda i=index: DecoderLayer(cfg, i, rngs=nnx.Rngs(0)))
    pieces.append((nnx.state(layer, nnx.Param), times))
  one = dataclasses.replace(cfg, num_layers=1, layer_kinds=("kda",),
                            moe=dataclasses.replace(cfg.moe, first_dense_layers=1))
  outer = nnx.state(nnx.eval_shape(lambda: HybridLM(one, rngs=nnx.Rngs(0))), nnx.Param)
  pieces.append((nnx.State({k: v for k, v in outer.items() if k != "layers"}), 1))
  return pieces


def resolve_mesh(mesh: MeshConfig) -> dict[str, int]:
  """-1 takes the local devices; without -1 the configured sizes define the device count."""
  sizes = [getattr(mesh, a) for a in MESH_AXES]
  if -1 in sizes:
    return mesh_shape(dataclasses.asdict(mesh),
                      max(jax.device_count(), math.prod(v for v in sizes if v != -1)))
  return mesh_shape(dataclasses.asdict(mesh), math.prod(sizes))


def estimate(run: RunConfig, plan: plan_lib.Plan) -> dict:
  """Counts and per-device bytes for `run` (model, train.optimizer, mesh)."""
  cfg = run.model
  mesh = resolve_mesh(run.mesh)
  counts = param_breakdown(cfg)
  total, active = sum(counts.values()), active_from_breakdown(cfg, counts)
  tx = optim.make_optimizer(run.train, plan.schedule())
  param_bytes = opt_bytes = 0
  for params, times in _param_pieces(cfg):
    param_bytes += times * _bytes(params)
    opt_bytes += times * _bytes(jax.eval_shape(tx.init, params))
  shard = mesh["fsdp"] * mesh["tensor"]
  expert_frac = counts["routed_experts"] / max(total, 1)
  per_param_split = (1 - expert_frac) / shard + expert_frac / (shard * mesh["expert"])
  return {
      "total": total, "active": active, "mesh": mesh,
      "devices": math.prod(mesh.values()), "param_bytes": param_bytes,
      "opt_bytes": opt_bytes, "per_device_param_bytes": param_bytes * per_param_split,
      "per_device_opt_bytes": opt_bytes * per_param_split,
      "optimizer": run.train.optimizer,
  }


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


# Memory one accelerator offers for params + optimizer + gradients + activations (H100/H200
# class, minus headroom for XLA scratch and fragmentation).
DEVICE_MEMORY_GIB = 64.0


def activation_bytes_per_token(cfg, seq_len: int, dtype: str) -> dict[str, float]:
  """Bytes of activations kept for the backward pass, per token of one sequence.

  Counts the tensors each sublayer saves (projections, conv outputs, gates, router scores,
  expert hidden states at k experts/token, norms and residual adds) in the compute `dtype`;
  "dots" keeps about half (matmul outputs only); "full" keeps each layer's input plus the
  AttnRes block buffer and recomputes one layer at a time. `attention_scores` is the
  [H, T] softmax row per query token that the dense MLA core materialises (fp32 logits +
  probabilities): quadratic in T per sequence. The blockwise core (`compute.mla_impl`,
  picked by "auto" beyond 4 blocks) keeps a log-sum-exp per head and query (4 H bytes per
  token) instead: `attention_scores_blockwise`; its [H, block, block] workspace is
  per layer, not per token (`blockwise_workspace_bytes`).
  """
  b = 2 if dtype in ("bfloat16", "float16") else 4
  d, k, m, moe = cfg.d_model, cfg.kda, cfg.mla, cfg.moe
  kda = 6 * d + 5 * k.num_heads * k.head_dim + 4 * k.num_v_heads * k.v_head_dim + k.num_heads
  mla = (6 * d + 2 * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
         + 2 * m.kv_lora_rank + 3 * m.num_heads * m.v_head_dim)
  width = moe.latent_dim or d
  routed = (4 * moe.num_experts // b + moe.experts_per_token * (3 * moe.expert_intermediate
                                                                + 2 * width))
  shared = 3 * moe.num_shared_experts * moe.shared_intermediate
  dense = 3 * moe.dense_intermediate + 4 * d
  layers, scores, lse = 0.0, 0.0, 0.0
  for i, kind in enumerate(cfg.layer_kinds):
    layers += kda if kind == "kda" else mla
    layers += (routed + shared + 4 * d) if cfg.is_moe_layer(i) else dense
    if kind != "kda":
      scores += 8.0 * m.num_heads * seq_len  # fp32 logits + probabilities, per query token
      lse += 4.0 * m.num_heads
  per_layer_max = max(kda, mla) + max(routed + shared + 4 * d, dense)
  blocks = math.ceil(cfg.num_layers / cfg.attnres.block_size) if cfg.attnres.enabled else 0
  n = max(cfg.num_layers, 1)
  return {
      "none": layers * b, "dots": 0.5 * layers * b,
      "full": (n * d * (1 + blocks) + per_layer_max) * b,
      "attention_scores": scores, "attention_scores_blockwise": lse,
  }


def blockwise_workspace_bytes(cfg, block: int, rows: float) -> float:
  """fp32 [rows, H, block, block] logits, probabilities and their gradient: one MLA layer's
  blockwise attention in flight (the backward's peak), whatever T."""
  return 3.0 * 4 * max(rows, 1.0) * cfg.mla.num_heads * block * block


def curriculum_report(run: RunConfig, plan: plan_lib.Plan, e: dict) -> str:
  """Plan and per-stage activation memory per device, with the least remat that fits."""
  cfg = run.model
  rows_split = e["mesh"]["data"] * e["mesh"]["fsdp"]  # batch rows are split over these axes
  static = e["per_device_param_bytes"] * 2 + e["per_device_opt_bytes"]  # + fp32 gradients
  budget = DEVICE_MEMORY_GIB * GiB
  lines = [plan_lib.describe(plan),
           f"activation memory per device (estimate; params + grads + optimizer "
           f"{_fmt_bytes(static)}; budget {DEVICE_MEMORY_GIB:g} GiB per device):"]
  context = e["mesh"].get("context", 1)   # each sequence split over this many devices
  compute = run.compute
  for s in plan.stages:
    per_tok = activation_bytes_per_token(cfg, s.seq_len, compute.dtype)
    rows = s.batch_size / rows_split
    tokens = max(rows, 1.0) * s.seq_len / context  # at least its share of one sequence
    mb = run.train.grad_accum
    acts = {p: per_tok[p] * tokens / mb for p in ("none", "dots", "full")}
    core = blockwise_resolve(compute.mla_impl, s.seq_len, compute.mla_block)[0]
    if core == "dense":
      scores = per_tok["attention_scores"] * s.seq_len * max(rows, 1.0) / context / mb
    else:
      scores = (per_tok["attention_scores_blockwise"] * tokens / mb
                + blockwise_workspace_bytes(cfg, compute.mla_block, rows / mb))
    fits = [p for p in ("none", "dots", "full") if static + acts[p] + scores <= budget]
    fits_flash = [p for p in ("none", "dots", "full") if static + acts[p] <= budget]
    if fits:
      need = f"fits with compute.remat='{fits[0]}'"
    elif fits_flash:
      need = (f"does not fit: the {core} MLA core's scores alone; with a fused attention "
              f"kernel: compute.remat='{fits_flash[0]}'")
    else:
      need = ("does not fit even with remat='full': raise train.grad_accum, mesh.context or "
              "add devices")
    cp = (f"; {rows:.2f} rows per data shard: needs mesh.context >= {math.ceil(1 / rows)}"
          if rows * context < 1 else "")
    lines.append(
        f"  stage {s.index} T={s.seq_len:,}: {rows:g} rows/data shard, context {context} | "
        f"activations none {_fmt_bytes(acts['none'])}, dots {_fmt_bytes(acts['dots'])}, "
        f"full {_fmt_bytes(acts['full'])} + MLA attention ({core}) {_fmt_bytes(scores)} | "
        f"{need}{cp}")
  return "\n".join(lines)


def dry_run(config: ml_collections.ConfigDict | RunConfig) -> dict:
  """Print the report (and the curriculum plan when there is one); return the estimate."""
  run = run_config_from_dict(config)
  plan = plan_lib.build_plan(run)
  e = estimate(run, plan)
  print(report(e), flush=True)
  if plan.curriculum:
    print(curriculum_report(run, plan, e), flush=True)
  return e
