"""Sigmoid top-k routing with a balancing bias, and routing replay (DESIGN s4.1, s9).

Conventions: m tokens, E routed experts, k experts per token.
  logits: [m, E] fp32 router logits; bias: [E] fp32 balancing bias (state, not a parameter);
  experts: [m, k] int32 expert ids.
The bias only chooses experts; the combine weights come from the unbiased scores, so the
balancer can move routing without touching what the chosen experts contribute.
`replay_route` keeps the choice fixed (experts recorded by an earlier forward, e.g. with the
rollout's parameters in RL) and recomputes only the weights from the current logits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routes(NamedTuple):
  """Routing decision for m tokens.

  Attributes:
    experts: [m, k] int32, the chosen experts, best (by score + bias) first (from
      `replay_route`: the given experts in the given order).
    weights: [m, k] fp32 combine weights, s[experts] / sum(s[experts]) * routed_scale.
    scores: [m, E] fp32, s = sigmoid(logits).
    cutoff: [m] fp32, the largest s + bias among the experts NOT chosen: for top-k routing
      alpha = the (k+1)-th largest value of s + bias (QB's token cutoff).
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
  weights = _combine_weights(scores, experts, routed_scale, renormalize)
  return Routes(experts=experts, weights=weights, scores=scores, cutoff=cutoff)


@functools.partial(jax.jit, static_argnames=("routed_scale", "renormalize"))
def replay_route(logits: jax.Array, experts: jax.Array, *, bias: jax.Array | None = None,
                 routed_scale: float = 1.0, renormalize: bool = True) -> Routes:
  """Route each token to the given experts, weighted by the current scores (routing replay).

  s = sigmoid(logits); p = s[experts] / sum(s[experts]) * routed_scale (renormalize=False:
  p = s[experts] * routed_scale): `sigmoid_topk_route`'s formula, so replaying that
  function's own experts reproduces its Routes exactly, field by field. Gradients reach the
  logits through p; the expert choice itself is an input.

  Args:
    logits, routed_scale, renormalize: as `sigmoid_topk_route`'s.
    experts: [m, k] int expert ids, distinct per token, each in [0, E) (not checked here:
      values may be traced; `model.decoder.check_routes` checks concrete ones).
    bias: optional [E] balancing bias (None: zeros); it only enters `cutoff`.

  Returns:
    `Routes` with experts = the given ids (int32, in the given order), weights [m, k] fp32,
    scores [m, E] fp32 and cutoff [m] fp32 = the largest s + bias over the experts NOT in
    `experts` (when `experts` is the top k of s + bias this is the (k+1)-th largest value,
    i.e. `sigmoid_topk_route`'s cutoff).

  Raises:
    ValueError: `experts` is not an integer [m, k] array with 0 < k < E.
  """
  m, num_experts = logits.shape
  if (experts.ndim != 2 or experts.shape[0] != m or not 0 < experts.shape[1] < num_experts
      or not jnp.issubdtype(experts.dtype, jnp.integer)):
    raise ValueError(f"experts must be integer [m={m}, k] with 0 < k < E={num_experts}, "
                     f"got {experts.dtype} {experts.shape}")
  experts = experts.astype(jnp.int32)
  scores = jax.nn.sigmoid(logits.astype(jnp.float32))
  bias = (jnp.zeros((num_experts,), jnp.float32) if bias is None
          else jax.lax.stop_gradient(bias.astype(jnp.float32)))
  chosen = jnp.any(experts[..., None] == jnp.arange(num_experts, dtype=jnp.int32), axis=-2)
  # The best expert left out: the same fp32 values top_k compares, so the max is exact.
  cutoff = jnp.max(jnp.where(chosen, -jnp.inf, jax.lax.stop_gradient(scores) + bias), axis=-1)
  weights = _combine_weights(scores, experts, routed_scale, renormalize)
  return Routes(experts=experts, weights=weights, scores=scores, cutoff=cutoff)


def _combine_weights(scores: jax.Array, experts: jax.Array, routed_scale: float,
                     renormalize: bool) -> jax.Array:
  """p = s[experts] (/ sum) * routed_scale: scores [m, E], experts [m, k] -> [m, k] fp32."""
  chosen = jnp.take_along_axis(scores, experts, axis=-1)
  if renormalize:
    return chosen / jnp.sum(chosen, axis=-1, keepdims=True) * routed_scale
  return chosen * routed_scale


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
