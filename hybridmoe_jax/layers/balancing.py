"""Routing-bias balancing of the MoE layers: statistics, update rule and metrics (DESIGN s4.2).

The one owner of all three:
  `routing_stats`   what a forward pass records per MoE layer (additive int32 arrays);
  `update_bias`     the rule of `MoEConfig.balancing` ("qb", "sign", "none") applied to the
                    stats summed over microbatches and shards;
  `layer_metrics`   what the monitor shows per layer (MaxVio, bias range, drop fraction, load).
Both MoE paths call `routing_stats`: the local one directly, the expert-parallel one on each
token shard inside its shard_map, followed by one integer psum (`parallel.ep_moe`).

Stats pytree: the model returns its routing statistics shaped like the pure dict of its
RoutingBias state (`nnx.to_pure_dict(biases)`, e.g. {"layers": {1: {"ffn": {"bias": s}}}}):
each bias leaf's position holds that layer's stats dict `s`, so updating every layer is one
tree map over (biases, stats) (`update_routing_biases`; a scanned layer stack keeps R
layers' biases in one [R, E] leaf with stats [R, ...], and the rule is vmapped over R).
The bias is routing state, never a parameter: it gets no gradient, is not in the
optimizer, and the value computed from step t's statistics is used from step t + 1.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import MoEConfig
from hybridmoe_jax.ops.quantile_balance import (bias_from_histogram, qb_histogram, qb_range,
                                                sign_rule_update)
from hybridmoe_jax.ops.routing import Routes, expert_load, max_violation
from hybridmoe_jax.config.sharding import path_string

Stats = dict[str, jax.Array]
_F32 = jnp.float32


def routing_stats(routes: Routes, bias: jax.Array, valid: jax.Array | None, cfg: MoEConfig,
                  *, dropped: jax.Array | None = None) -> Stats:
  """One MoE layer's balancing statistics for m tokens (additive over microbatches/shards).

  Args:
    routes: the router's `Routes` (experts [m, k], scores [m, E], cutoff [m]).
    bias: [E] fp32, the bias the routes were chosen with (fixes the QB histogram range).
    valid: optional [m] bool, True for real tokens (padding is not counted).
    cfg: the layer's MoEConfig (num_experts, experts_per_token, balancing, qb_num_bins).
    dropped: int32 [] valid assignments an expert-parallel buffer dropped (None: 0).

  Returns:
    int32 arrays: "load" [E] assignments of valid tokens, "dropped" [], and, with balancing
    "qb", "qb_hist" [E, qb_num_bins] (the histogram the QB update reads).
  """
  stats = {"load": expert_load(routes.experts, cfg.num_experts, valid),
           "dropped": (jnp.zeros((), jnp.int32) if dropped is None
                       else jnp.asarray(dropped, jnp.int32))}
  if cfg.balancing == "qb":
    stats["qb_hist"] = qb_histogram(routes.scores, bias, cfg.experts_per_token,
                                    cfg.qb_num_bins, valid, cutoff=routes.cutoff)
  return stats


@functools.partial(jax.jit, static_argnames=("cfg",))
def update_bias(bias: jax.Array, stats: Stats, cfg: MoEConfig) -> jax.Array:
  """The per-layer balancing rule (outside the gradient).

  Args:
    bias: [E] fp32, the bias the step routed with (it fixes the QB histogram range).
    stats: `routing_stats` summed over microbatches and shards.
    cfg: the layer's MoEConfig (`balancing`, `sign_gamma`).

  Returns:
    [E] fp32 bias for the next step: "qb" -> quantile from the pooled histogram at target
    sum(load) / E (unchanged when no token was valid); "sign" -> DeepSeek's sign rule;
    "none" -> unchanged.
  """
  bias = jax.lax.stop_gradient(bias.astype(_F32))
  load = jax.lax.stop_gradient(stats["load"])
  if cfg.balancing == "qb":
    total = jnp.sum(load).astype(_F32)
    new = bias_from_histogram(stats["qb_hist"], *qb_range(bias), total / cfg.num_experts)
    return jnp.where(total > 0, new, bias)
  if cfg.balancing == "sign":
    return sign_rule_update(load, bias, cfg.sign_gamma)
  return bias


@jax.jit
def layer_metrics(bias: jax.Array, stats: Stats) -> dict[str, jax.Array]:
  """Monitor metrics of one layer, with the bias the step routed with.

  Returns:
    fp32 scalars "max_vio" (of the load), "bias_min", "bias_max", "drop_frac" (dropped /
    routed valid assignments; 0 when dropless) and "load" [E] int32.
  """
  load = stats["load"]
  routed = jnp.maximum(jnp.sum(load).astype(_F32), 1.0)
  return {"max_vio": max_violation(load),
          "bias_min": jnp.min(bias).astype(_F32),
          "bias_max": jnp.max(bias).astype(_F32),
          "drop_frac": stats["dropped"].astype(_F32) / routed,
          "load": load}


def _per_layer(fn, bias: jax.Array, stats: Stats):
  """fn(bias [E], stats) on one layer's bias, or vmapped over the leading axis of a stacked
  one (a scanned layer stack: bias [R, E], every stats array [R, ...])."""
  return fn(bias, stats) if bias.ndim == 1 else jax.vmap(fn)(bias, stats)


def update_routing_biases(biases: nnx.State, stats: Any, cfg: MoEConfig, *,
                          layer_name: Callable[[str, int], str] | None = None
                          ) -> tuple[nnx.State, dict[str, dict[str, jax.Array]]]:
  """Apply the balancing rule to every MoE layer's bias (inside the jitted train step).

  Args:
    biases: the model's RoutingBias state: one [E] fp32 leaf per MoE layer, or [R, E] for
      R layers stacked in one module (`compute.scan_layers`, `model.stack`).
    stats: aux["moe"] of the forward summed over microbatches: the pure-dict shape of
      `biases` with a `routing_stats` dict at each bias leaf (stacked: arrays [R, ...]).
    cfg: the model's MoEConfig (every MoE layer shares it).
    layer_name: (stacked module path, r) -> the per-layer name of repeat r's metrics
      (`model.stack.unstacked_name`); default "<path>/<r>".

  Returns:
    (new biases, same structure; {MoE module path, e.g. "layers/1/ffn": `layer_metrics`
    computed with the OLD bias}, one entry per layer, stacked or not).
  """
  old = jax.lax.stop_gradient(nnx.to_pure_dict(biases))
  rule = lambda b, s: update_bias(b, s, cfg)
  # `stats` has `old` as a tree prefix: each bias leaf meets its layer's whole stats dict.
  new = jax.tree.map(lambda b, s: _per_layer(rule, b, s), old, stats)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(old)
  metrics = {}
  for (path, b), s in zip(leaves, treedef.flatten_up_to(stats)):
    name, m = path_string(path[:-1]), _per_layer(layer_metrics, b, s)
    if b.ndim == 1:
      metrics[name] = m
      continue
    for r in range(b.shape[0]):
      key = layer_name(name, r) if layer_name is not None else f"{name}/{r}"
      metrics[key] = jax.tree.map(lambda a, r=r: a[r], m)
  out = jax.tree.map(lambda v: v, biases)   # a fresh State: the input stays untouched
  nnx.replace_by_pure_dict(out, new)
  return out, metrics
