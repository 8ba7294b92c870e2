"""Routing-bias updates for every MoE layer of the model (run inside the jitted train step).

The biases are `RoutingBias` variables, split from the parameters with
`nnx.split(model, nnx.Param, RoutingBias, ...)`; they never receive gradients and are not in
the optimizer state. The bias computed from step t's statistics is used from step t + 1.
"""

from typing import Any

import jax
from flax import nnx

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.layers.moe import moe_metrics, update_bias


def _layer_name(path: tuple) -> str:
  keys = [str(p) for p in path]
  return f"layer_{keys[keys.index('layers') + 1]}"


def update_routing_biases(biases: nnx.State, moe_stats: dict[str, dict[str, jax.Array]],
                          cfg: ModelConfig) -> tuple[nnx.State, dict[str, dict[str, Any]]]:
  """Apply the configured balancing rule to each MoE layer's bias.

  Args:
    biases: the model's RoutingBias state (one [E] fp32 leaf per MoE layer).
    moe_stats: aux["moe"] of the forward, summed over microbatches (additive int32 stats).
    cfg: the model config (balancing rule, number of bins).
  Returns:
    (new biases with the same structure, per-layer metrics computed with the OLD bias:
    max_vio, bias_min, bias_max).
  """
  flat = nnx.to_flat_state(biases)
  new_leaves, metrics = [], {}
  for path, var in flat:
    name = _layer_name(path)
    old = jax.lax.stop_gradient(var.get_value())
    metrics[name] = moe_metrics(old, moe_stats[name])
    new_leaves.append((path, var.replace(update_bias(old, moe_stats[name], cfg.moe))))
  return nnx.from_flat_state(new_leaves), metrics
