"""`--dry_run`: parameter counts and per-device parameter + optimizer memory, nothing allocated.

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

from hybridmoe_jax.config import model_config_from_dict
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.count import active_from_breakdown, param_breakdown
from hybridmoe_jax.model.decoder import DecoderLayer
from hybridmoe_jax.train import optim
from hybridmoe_jax.train.config import MESH_AXES, mesh_shape, validate_train_config

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


def resolve_mesh(mesh: ml_collections.ConfigDict) -> dict[str, int]:
  """-1 takes the local devices; without -1 the configured sizes define the device count."""
  if any(int(mesh[a]) == -1 for a in MESH_AXES):
    fixed = math.prod(int(mesh[a]) for a in MESH_AXES if int(mesh[a]) != -1)
    return mesh_shape(mesh, max(jax.device_count(), fixed))
  return mesh_shape(mesh, math.prod(int(mesh[a]) for a in MESH_AXES))


def estimate(config: ml_collections.ConfigDict) -> dict:
  """Counts and per-device bytes for `config` (model, train.optimizer, mesh)."""
  validate_train_config(config)
  cfg = model_config_from_dict(config.model)
  mesh = resolve_mesh(config.mesh)
  counts = param_breakdown(cfg)
  total, active = sum(counts.values()), active_from_breakdown(cfg, counts)
  tx = optim.make_optimizer(config.train)
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
      "optimizer": config.train.optimizer,
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


def dry_run(config: ml_collections.ConfigDict) -> dict:
  """Print the report; return the estimate."""
  e = estimate(config)
  print(report(e), flush=True)
  return e
