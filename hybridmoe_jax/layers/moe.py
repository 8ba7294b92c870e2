"""Sparse MoE feed-forward: sigmoid router, latent experts, Quantile Balancing (DESIGN s4).

Conventions: B batch, T tokens, d hidden, m = B T tokens, E routed experts, k per token,
I expert width, n_in = expert input width (latent l, else d).
  router [d, E] fp32; bias [E] fp32 (RoutingBias state, never a Param);
  w_gate, w_up [E, n_in, I]; w_down [E, I, n_in]; all parameters fp32, matmuls in `dtype`.
The balancing bias only selects experts; the train step updates it from the additive stats
this layer returns (`update_bias`), outside the gradient and the optimizer.
Under a multi-device mesh context (`jax.set_mesh`), impl="ragged" runs expert-parallel
(`parallel.ep_moe`: shard_map over "expert", ragged all-to-all, dropless unless
`capacity_factor` > 0) and the statistics are psum-ed over every token shard.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import MoEConfig
from hybridmoe_jax.layers.norms import RMSNorm
from hybridmoe_jax.ops.glu import get_glu
from hybridmoe_jax.ops.quantile_balance import (bias_from_histogram, qb_histogram, qb_range,
                                                sign_rule_update)
from hybridmoe_jax.ops.routing import expert_load, max_violation, sigmoid_topk_route
from hybridmoe_jax import sharding
from hybridmoe_jax.parallel import ep_moe

ExpertImpl = Literal["ragged", "dense"]
_F32 = jnp.float32


class RoutingBias(nnx.Variable):
  """Balancing bias [E] fp32: routing state, not a parameter (no gradient, no optimizer)."""


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> nnx.Param:
  """fp32 Param ~ N(0, 1/fan_in)."""
  init = nnx.initializers.normal(stddev=fan_in ** -0.5)
  return nnx.Param(init(rngs.params(), shape, _F32))


def _mm(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """x @ w in `dtype` with fp32 accumulation; returns fp32."""
  return jnp.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=_F32)


class GLUMLP(nnx.Module):
  """Full-width GLU FFN without biases: y = W_down glu(x W_gate, x W_up).

  Used for the dense first layer and the fused shared experts.
  """

  def __init__(self, d_in: int, d_hidden: int, *, glu: str, dtype: str, rngs: nnx.Rngs):
    self.glu = glu
    self.dtype = jnp.dtype(dtype)
    self.gate = _normal(rngs, (d_in, d_hidden), d_in)
    self.up = _normal(rngs, (d_in, d_hidden), d_in)
    self.down = _normal(rngs, (d_hidden, d_in), d_hidden)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., d_in] -> y [..., d_in] in the compute dtype (GLU itself in fp32)."""
    h = get_glu(self.glu)(_mm(x, self.gate[...], self.dtype), _mm(x, self.up[...], self.dtype))
    return _mm(h, self.down[...], self.dtype).astype(self.dtype)


def _ragged_experts(x, experts, weights, w_gate, w_up, w_down, glu, dtype):
  """Dropless grouped expert FFN: sort the m k assignments by expert, ragged_dot, unsort.

  x [m, n_in] (dtype), experts [m, k] int32, weights [m, k] fp32 -> [m, n_in] fp32.
  Cost tracks m k, not m E.
  """
  m, k = experts.shape
  num_experts = w_gate.shape[0]
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)                     # sorted slot -> assignment
  sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
  xs = jnp.take(x, order // k, axis=0).astype(dtype)          # [m k, n_in], grouped by expert
  dot = lambda a, w: jax.lax.ragged_dot(a.astype(dtype), w.astype(dtype), sizes,
                                        preferred_element_type=_F32)
  h = glu(dot(xs, w_gate), dot(xs, w_up))
  ys = dot(h, w_down)                                         # [m k, n_in] fp32
  slot = jnp.zeros_like(order).at[order].set(jnp.arange(m * k, dtype=order.dtype),
                                             unique_indices=True)
  y = jnp.take(ys, slot, axis=0).reshape(m, k, -1)            # back to [m, k, n_in]
  return jnp.einsum("mk,mki->mi", weights, y)


def _dense_experts(x, experts, weights, w_gate, w_up, w_down, glu, dtype):
  """Reference: every expert on every token, combined by a one-hot [m, E] weight matrix.

  Same contract as `_ragged_experts`; cost m E.
  """
  num_experts = w_gate.shape[0]
  combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=_F32) * weights[..., None],
                    axis=1)                                   # [m, E]
  ein = lambda s, a, w: jnp.einsum(s, a.astype(dtype), w.astype(dtype),
                                   preferred_element_type=_F32)
  h = glu(ein("mi,eif->emf", x, w_gate), ein("mi,eif->emf", x, w_up))
  y = ein("emf,efi->emi", h, w_down)
  return jnp.einsum("me,emi->mi", combine, y)


_EXPERT_IMPLS = {"ragged": _ragged_experts, "dense": _dense_experts}


class MoE(nnx.Module):
  """Routed (optionally latent) experts plus fused shared experts.

  latent:  y = W_up RMSNorm(sum_e p_e Expert_e(W_down x)) + Shared(x)
  else:    y = sum_e p_e Expert_e(x) + Shared(x)
  with routes and p from `sigmoid_topk_route` (the bias chooses, the scores weigh).
  """

  def __init__(self, d_model: int, cfg: MoEConfig, *, norm_eps: float, dtype: str,
               rngs: nnx.Rngs, impl: ExpertImpl = "ragged"):
    if impl not in _EXPERT_IMPLS:
      raise ValueError(f"impl={impl!r} is invalid: allowed one of {sorted(_EXPERT_IMPLS)}")
    self.cfg = cfg
    self.impl = impl
    self.dtype = jnp.dtype(dtype)
    e, i_dim = cfg.num_experts, cfg.expert_intermediate
    n_in = cfg.latent_dim or d_model
    self.router = _normal(rngs, (d_model, e), d_model)
    self.bias = RoutingBias(jnp.zeros((e,), _F32))
    if cfg.latent_dim:
      self.latent_down = _normal(rngs, (d_model, n_in), d_model)
      self.latent_norm = RMSNorm(n_in, eps=norm_eps)
      self.latent_up = _normal(rngs, (n_in, d_model), n_in)
    self.w_gate = _normal(rngs, (e, n_in, i_dim), n_in)
    self.w_up = _normal(rngs, (e, n_in, i_dim), n_in)
    self.w_down = _normal(rngs, (e, i_dim, n_in), i_dim)
    width = cfg.num_shared_experts * cfg.shared_intermediate
    self.shared = (GLUMLP(d_model, width, glu=cfg.glu, dtype=dtype, rngs=rngs)
                   if width else None)

  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Apply the MoE FFN and collect this batch's balancing statistics.

    Args:
      x: [B, T, d] activations (any float dtype).
      mask: optional [B, T] bool, True for real tokens; padding is still computed but
        excluded from the statistics.

    Returns:
      y: [B, T, d] in the compute dtype.
      stats: additive int32 arrays (sum them over microbatches and shards):
        "load" [E] assignments of valid tokens; "qb_hist" [E, qb_num_bins] (balancing "qb");
        under a multi-device mesh also "dropped" [] valid assignments dropped by the
        expert-parallel buffer (0 unless `capacity_factor` > 0).
    """
    cfg, dtype = self.cfg, self.dtype
    b, t, d = x.shape
    x = sharding.constrain(x, ("batch", "length", "act_embed"))
    xf = x.reshape(b * t, d)
    valid = None if mask is None else mask.reshape(b * t)
    # Inside a multi-device mesh context (`jax.set_mesh`) the ragged path runs expert-parallel.
    mesh = jax.sharding.get_abstract_mesh()
    sharded = self.impl == "ragged" and ep_moe.use_expert_parallel(mesh)
    bias = self.bias[...]
    # Router in fp32 at full precision: bf16/TF32 logits would flip near-tied routes.
    logits = jnp.dot(xf.astype(_F32), self.router[...], precision=jax.lax.Precision.HIGHEST)
    routes = sigmoid_topk_route(logits, bias, cfg.experts_per_token,
                                routed_scale=cfg.routed_scale)
    h = xf.astype(dtype)
    if cfg.latent_dim:
      h = _mm(h, self.latent_down[...], dtype).astype(dtype)
    if sharded:
      ok = jnp.ones((b * t,), bool) if valid is None else valid
      y, dropped = ep_moe.expert_parallel_ffn(
          h, routes.experts, routes.weights, ok, self.w_gate[...], self.w_up[...],
          self.w_down[...], glu=get_glu(cfg.glu), dtype=dtype,
          capacity_factor=cfg.capacity_factor)
    else:
      y = _EXPERT_IMPLS[self.impl](h, routes.experts, routes.weights, self.w_gate[...],
                                   self.w_up[...], self.w_down[...], get_glu(cfg.glu), dtype)
    if cfg.latent_dim:
      y = _mm(self.latent_norm(y), self.latent_up[...], dtype)
    if self.shared is not None:
      y = y + self.shared(xf).astype(_F32)
    qb_bins = cfg.qb_num_bins if cfg.balancing == "qb" else None
    if sharded:
      # Per-shard counts, one integer psum over all token shards: the pooled histogram.
      stats = ep_moe.sharded_routing_stats(routes.experts, routes.scores, routes.cutoff, bias,
                                           ok, num_experts=cfg.num_experts,
                                           k=cfg.experts_per_token, num_bins=qb_bins)
      stats["dropped"] = dropped
    else:
      stats = {"load": expert_load(routes.experts, cfg.num_experts, valid)}
      if qb_bins:
        stats["qb_hist"] = qb_histogram(routes.scores, bias, cfg.experts_per_token,
                                        qb_bins, valid, cutoff=routes.cutoff)
    y = sharding.constrain(y.astype(dtype).reshape(b, t, d), ("batch", "length", "act_embed"))
    return y, stats


@functools.partial(jax.jit, static_argnames=("cfg",))
def update_bias(bias: jax.Array, stats: dict[str, jax.Array], cfg: MoEConfig) -> jax.Array:
  """The per-layer balancing update of the train step (outside the gradient).

  Args:
    bias: [E] fp32, the bias the step routed with (it fixes the QB histogram range).
    stats: the layer's stats summed over microbatches and shards ("load", "qb_hist").
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
def moe_metrics(bias: jax.Array, stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Per-layer balancing metrics: MaxVio of the load and the bias range (fp32 scalars)."""
  return {"max_vio": max_violation(stats["load"]),
          "bias_min": jnp.min(bias).astype(_F32),
          "bias_max": jnp.max(bias).astype(_F32)}
