"""Quantile Balancing: the auxiliary-loss-free bias update (DESIGN s4.2).

Conventions: m tokens, E experts, k experts per token, n = m k / E target assignments each.
  scores s: [m, E] fp32 sigmoid router scores; bias b: [E] fp32; mask: [m] bool valid tokens.
With this step's cutoffs alpha_i (the (k+1)-th largest s_i + b, old bias) held fixed, token i
picks expert j iff b_j > r_ij := alpha_i - s_ij. So the bias that gives every expert exactly n
tokens is, per expert, the (n/m)-quantile of r[:, j]. The cutoffs move with the bias, which is
why a fixed batch needs a few updates rather than one. A common shift of b changes no route,
so every result is mean-centred. Nothing here is differentiated: all inputs are
stop_gradient-ed.
Ties: the token whose (k+1)-th expert is j has r_ij = b_old_j exactly, so r[:, j] holds a
cluster of equal values at the old bias; when n falls inside it no threshold can split it and
the new b_j lands on the cluster (the count below is then within the cluster, not exactly n).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from hybridmoe_jax.ops.routing import expert_load, top_k_with_cutoff

QBMethod = Literal["exact", "histogram"]


def _residuals(scores, bias, k, cutoff=None):
  """r = alpha - s: [m, E] fp32, alpha from the old bias unless `cutoff` [m] is given."""
  scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
  bias = jax.lax.stop_gradient(bias.astype(jnp.float32))
  if cutoff is None:
    cutoff = top_k_with_cutoff(scores + bias, k)[1]
  return jax.lax.stop_gradient(cutoff.astype(jnp.float32))[:, None] - scores


def _check_k(k: int, num_experts: int) -> None:
  """Raises ValueError unless 0 < k < E (the (k+1)-th largest score is the cutoff)."""
  if not 0 < k < num_experts:
    raise ValueError(f"need 0 < k < E for the (k+1)-th cutoff, got k={k}, E={num_experts}")


def _num_valid(m: int, mask) -> jax.Array:
  if mask is None:
    return jnp.asarray(m, jnp.float32)
  return jnp.sum(mask.astype(jnp.float32))


def _centre(b: jax.Array) -> jax.Array:
  return b - jnp.mean(b)


def qb_range(bias: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Histogram range [lo, hi] = [min(b) - 1, max(b) + 1]: r lies inside since s is in (0, 1).

  Args:
    bias: [E] the bias the step routed with.

  Returns:
    (lo, hi), fp32 scalars.
  """
  bias = jax.lax.stop_gradient(bias.astype(jnp.float32))
  return jnp.min(bias) - 1.0, jnp.max(bias) + 1.0


@functools.partial(jax.jit, static_argnames=("k", "num_bins"))
def qb_histogram(scores: jax.Array, bias: jax.Array, k: int, num_bins: int,
                 mask: jax.Array | None = None, *,
                 cutoff: jax.Array | None = None) -> jax.Array:
  """Per-expert int32 histogram of r = alpha - s over `qb_range(bias)`.

  Additive: the histograms of microbatches or shards routed with the same bias sum to the
  histogram of their concatenation, so one integer all-reduce gives the global quantile.

  Args:
    scores: [m, E] sigmoid scores.
    bias: [E] the bias used for routing (fixes alpha and the range).
    k: experts per token (static).
    num_bins: bins per expert (static).
    mask: optional [m] bool; False tokens are not counted.
    cutoff: optional [m] alpha already computed by the router (saves a top_k).

  Returns:
    [E, num_bins] int32 counts; values outside the range are clipped into the end bins.

  Raises:
    ValueError: k outside 0 < k < E, or num_bins < 1.
  """
  _check_k(k, scores.shape[-1])
  if num_bins < 1:  # zero bins: an empty histogram, then a NaN bias
    raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
  r = _residuals(scores, bias, k, cutoff)
  num_experts = r.shape[1]
  lo, hi = qb_range(bias)
  width = (hi - lo) / num_bins
  idx = jnp.clip(jnp.floor((r - lo) / width), 0, num_bins - 1).astype(jnp.int32)
  # Token i counts once in cell (j, idx_ij) of every expert j: a load over E x num_bins cells.
  cells = jnp.arange(num_experts, dtype=jnp.int32) * num_bins + idx     # [m, E]
  return expert_load(cells, num_experts * num_bins, mask).reshape(num_experts, num_bins)


def _histogram_quantile(hist, lo, hi, target):
  """Uncentred [E]: where each expert's cumulative count reaches `target` (linear in-bin)."""
  hist = jax.lax.stop_gradient(hist)
  num_bins = hist.shape[-1]
  counts = hist.astype(jnp.float32)
  cum = jnp.cumsum(counts, axis=-1)
  target = jnp.asarray(target, jnp.float32)
  # First bin whose cumulative count reaches the target; the last bin if none does.
  c = jnp.minimum(jnp.sum(cum < target, axis=-1), num_bins - 1)
  in_bin = jnp.take_along_axis(counts, c[:, None], axis=-1)[:, 0]
  before = jnp.take_along_axis(cum, c[:, None], axis=-1)[:, 0] - in_bin
  frac = jnp.clip((target - before) / jnp.maximum(in_bin, 1.0), 0.0, 1.0)
  width = (hi - lo) / num_bins
  return lo + (c.astype(jnp.float32) + frac) * width


def bias_from_histogram(hist: jax.Array, lo: jax.Array, hi: jax.Array,
                        target: jax.Array | float) -> jax.Array:
  """New mean-centred bias from (pooled) QB histograms.

  b_j = the value where expert j's cumulative count reaches `target`, interpolating linearly
  inside the bin that reaches it; then b -= mean(b).

  Args:
    hist: [E, num_bins] int32 counts from `qb_histogram` (summed over microbatches/shards).
    lo, hi: the `qb_range` of the bias the histogram was built with.
    target: n = m k / E assignments per expert (fp32; m = valid tokens of the whole pool).

  Returns:
    [E] fp32 mean-centred bias for the next step.
  """
  return _centre(_histogram_quantile(hist, lo, hi, target))


def _exact_quantile(r, n, mask, n_max: float):
  """Uncentred [E]: per column, a value with exactly n of r[:, j] below it (integer n, no tie).

  Order statistic at 1-based position n + 1/2, interpolated: midway between the n-th and
  (n+1)-th smallest for integer n, linear between neighbours otherwise. `n_max` >= n is a
  static bound (m k / E).
  """
  m = r.shape[0]
  if mask is not None:
    r = jnp.where(mask[:, None], r, jnp.inf)  # invalid tokens sort last
  m_valid = _num_valid(m, mask)
  # Only the ~n smallest values per expert matter: top_k to a static depth is far cheaper
  # than a full sort over m (about 20x on CPU at m=4096, E=896).
  depth = min(m, int(n_max + 0.5) + 2)
  smallest = -jax.lax.top_k(-r.T, depth)[0]  # [E, depth] ascending
  last = jnp.clip(m_valid - 1.0, 0.0, depth - 1.0)
  pos = jnp.clip(n - 0.5, 0.0, last)  # 0-based fractional position
  i0 = jnp.floor(pos).astype(jnp.int32)
  i1 = jnp.minimum(i0 + 1, last.astype(jnp.int32))
  frac = pos - i0.astype(jnp.float32)
  r0 = jnp.take(smallest, i0, axis=1)
  r1 = jnp.take(smallest, i1, axis=1)
  return r0 + frac * (r1 - r0)


@functools.partial(jax.jit, static_argnames=("k", "method", "num_bins", "centre"))
def quantile_balance(scores: jax.Array, bias: jax.Array, k: int, *,
                     method: QBMethod = "exact", num_bins: int = 1000,
                     mask: jax.Array | None = None, centre: bool = True) -> jax.Array:
  """One Quantile Balancing update from one batch: b_new[j] = quantile_{k/E}(r[:, j]).

  Args:
    scores: [m, E] fp32 sigmoid scores of the batch.
    bias: [E] the bias the batch was routed with (fixes the cutoffs alpha).
    k: experts per token (static).
    method: "exact" (order statistics per expert) or "histogram" (`qb_histogram` then
      `bias_from_histogram`, the form the train step uses).
    num_bins: histogram bins (static, histogram method only).
    mask: optional [m] bool valid tokens; n = (#valid) k / E.
    centre: subtract the mean (the default; False gives the raw quantiles, for tests).

  Returns:
    [E] fp32 new bias, used from the next step.

  Raises:
    ValueError: k outside 0 < k < E, or (histogram) num_bins < 1.
  """
  m, num_experts = scores.shape
  _check_k(k, num_experts)
  m_valid = _num_valid(m, mask)
  n = m_valid * k / num_experts
  if method == "exact":
    b = _exact_quantile(_residuals(scores, bias, k), n, mask, m * k / num_experts)
  elif method == "histogram":
    hist = qb_histogram(scores, bias, k, num_bins, mask)
    b = _histogram_quantile(hist, *qb_range(bias), n)
  else:
    raise ValueError(f"unknown QB method {method!r}: allowed 'exact', 'histogram'")
  b = _centre(b) if centre else b
  # A batch without valid tokens carries no load information: keep the old bias.
  return jnp.where(m_valid > 0, b, bias.astype(jnp.float32))


def sign_rule_update(load: jax.Array, bias: jax.Array, gamma: float) -> jax.Array:
  """DeepSeek-V3 baseline: b_j - gamma * sign(load_j - mean(load)).

  Args:
    load: [E] assignment counts.
    bias: [E] current bias.
    gamma: step size (1e-3 in DeepSeek-V3).

  Returns:
    [E] fp32 bias (not re-centred, as in the original rule).
  """
  load = jax.lax.stop_gradient(load.astype(jnp.float32))
  bias = jax.lax.stop_gradient(bias.astype(jnp.float32))
  return bias - gamma * jnp.sign(load - jnp.mean(load))
