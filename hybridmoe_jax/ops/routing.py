"""Sigmoid top-k routing with a balancing bias (DESIGN s4.1).

Conventions: m tokens, E routed experts, k experts per token.
  logits: [m, E] fp32 router logits; bias: [E] fp32 balancing bias (state, not a parameter).
The bias only chooses experts; the combine weights come from the unbiased scores, so the
balancer can move routing without touching what the chosen experts contribute.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routes(NamedTuple):
  """Routing decision for m tokens.

  Attributes:
    experts: [m, k] int32, the chosen experts, best (by score + bias) first.
    weights: [m, k] fp32 combine weights, s[experts] / sum(s[experts]) * routed_scale.
    scores: [m, E] fp32, s = sigmoid(logits).
    cutoff: [m] fp32, alpha = the (k+1)-th largest value of s + bias (QB's token cutoff).
  """

  experts: jax.Array
  weights: jax.Array
  scores: jax.Array
  cutoff: jax.Array


@functools.partial(jax.jit, static_argnames=("k", "routed_scale", "renormalize"))
def sigmoid_topk_route(logits: jax.Array, bias: jax.Array, k: int, *,
                       routed_scale: float = 1.0, renormalize: bool = True) -> Routes:
  """Route each token to the k experts with the largest sigmoid(logits) + bias.

  s = sigmoid(logits); top = top_k(s + b, k + 1); routes = first k;
  p = s[routes] / sum(s[routes]) * routed_scale (renormalize=False: p = s[routes] *
  routed_scale, as Kimi-Linear's moe_renormalize=false or top-1 routing). Gradients reach
  the logits through p only; the bias is stop_gradient-ed and never enters p.

  Args:
    logits: [m, E] router logits (cast to fp32).
    bias: [E] balancing bias.
    k: experts per token (static), k < E.
    routed_scale: constant multiplier of the normalised weights.
    renormalize: divide the chosen scores by their sum (the default).

  Returns:
    `Routes` (experts [m, k] int32, weights [m, k] fp32, scores [m, E] fp32, cutoff [m] fp32).
  """
  num_experts = logits.shape[-1]
  if not 0 < k < num_experts:
    raise ValueError(f"need 0 < k < E for the (k+1)-th cutoff, got k={k}, E={num_experts}")
  scores = jax.nn.sigmoid(logits.astype(jnp.float32))
  bias = jax.lax.stop_gradient(bias.astype(jnp.float32))
  # Selection is discrete: no gradient flows through top_k (nor, therefore, the bias).
  experts, cutoff = top_k_with_cutoff(jax.lax.stop_gradient(scores) + bias, k)
  chosen = jnp.take_along_axis(scores, experts, axis=-1)
  if renormalize:
    weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True) * routed_scale
  else:
    weights = chosen * routed_scale
  return Routes(experts=experts, weights=weights, scores=scores, cutoff=cutoff)


def top_k_with_cutoff(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Indices of the k largest entries per row and the (k+1)-th largest value.

  Args:
    x: [m, E] fp32 (scores + bias), E > k.
    k: static.

  Returns:
    (indices [m, k] int32 in descending value order, cutoff [m] fp32).
  """
  vals, idx = jax.lax.top_k(x, k + 1)
  # XLA:CPU rewrites top_k into a full sort when its outputs are sliced at a non-zero start
  # (v[:, k]) or sliced together with the values (~30x slower at E=896). min() of the sorted
  # values and a gather of the first k columns keep the fast TopK path.
  cutoff = jnp.min(vals, axis=-1)
  experts = jnp.take(idx, jnp.arange(k), axis=1).astype(jnp.int32)
  return experts, cutoff


@functools.partial(jax.jit, static_argnames=("num_experts",))
def expert_load(experts: jax.Array, num_experts: int,
                mask: jax.Array | None = None) -> jax.Array:
  """Assignments per expert, counting only valid tokens.

  Args:
    experts: [m, k] int expert ids.
    num_experts: E (static).
    mask: optional [m] bool, True for tokens that count.

  Returns:
    [E] int32 load; additive across microbatches and shards.
  """
  ones = jnp.ones(experts.shape, jnp.int32)
  if mask is not None:
    ones = ones * mask.astype(jnp.int32)[:, None]
  return jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(ones.reshape(-1))


@jax.jit
def max_violation(load: jax.Array) -> jax.Array:
  """MaxVio = max_j load_j / mean(load) - 1 (0 when nothing was routed).

  Args:
    load: [E] assignment counts (any numeric dtype).

  Returns:
    fp32 scalar; 0 for a perfectly balanced load.
  """
  load = load.astype(jnp.float32)
  mean = jnp.mean(load)
  return jnp.where(mean > 0, jnp.max(load) / jnp.maximum(mean, 1e-30) - 1.0, 0.0)
