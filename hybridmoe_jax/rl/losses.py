"""RL objectives (DESIGN s9 "Exact forms"): advantages, DAPO reward shaping, policy losses,
KL estimators, loss aggregation and the ratio / entropy metrics.

Host side (numpy, run once per batch of finished episodes before the batch is built):
    rewards  float [N]   one reward per episode
    groups   int [N]     group id per episode (episodes of one prompt); any ids, any order
    lengths  int [N]     generated tokens per episode (overlong shaping)
    -> float32 [N] advantages / penalties, bool [N] signal mask.

Token level (jax.numpy, jit-able, all fp32; shapes and modes are static):
    lp, lp_old, lp_ref  float32 [B, T]  per-token log-probs: current policy, behaviour
                                        policy (the rollout's raw logp), frozen reference
    mask                float32 [B, T]  loss mask in {0, 1} (1 on sampled assistant tokens)
    adv                 float32 [B]     advantage per episode (row), broadcast over T
Token losses are computed at every position and masked by `aggregate` (with `where`, so a
non-finite value at a masked position never reaches the loss value). Gradients, however,
pass through every position's formula: keep the inputs finite at masked positions (the
learner's lp and the rollout's logp are finite log-probs there; logp is 0).
Hyper-parameters (eps_low, eps_high, tau, norm_len) are python numbers, checked before any
compute; close over them (functools.partial) when jitting.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe_jax.config import is_int, is_number
from hybridmoe_jax.config.rl import ADVANTAGES as ADV_MODES, AGG_MODES

KL_KINDS = ("k1", "k3")


# ----------------------------------------------------------------------------- host side

def _rewards_groups(rewards, groups) -> tuple[np.ndarray, np.ndarray]:
  """Checked float64 rewards [N] and dense group indices [N] (0..G-1)."""
  r = np.asarray(rewards)
  g = np.asarray(groups)
  if r.ndim != 1 or not (np.issubdtype(r.dtype, np.floating)
                         or np.issubdtype(r.dtype, np.integer)):
    raise ValueError(f"rewards: allowed a 1-D float array [N], got shape {r.shape} "
                     f"dtype {r.dtype}")
  if g.shape != r.shape or not np.issubdtype(g.dtype, np.integer):
    raise ValueError(f"groups: allowed an int array shaped like rewards {r.shape}, got "
                     f"shape {g.shape} dtype {g.dtype}")
  r = r.astype(np.float64)
  if not np.all(np.isfinite(r)):
    raise ValueError(f"rewards: allowed finite values, got {r[~np.isfinite(r)][:4]}")
  _, dense = np.unique(g, return_inverse=True)
  return r, dense.reshape(-1)


def advantages(rewards, groups, mode: str, *, eps: float = 1e-6, ddof: int = 1
               ) -> np.ndarray:
  """Per-episode advantages from rewards within each group.

  grpo:   (r - mean_g) / (std_g + eps), std_g = sqrt(sum_g (r - mean_g)^2 / (n_g - ddof)):
          ddof 1 (default) is the sample std of TRL and verl (torch.std), ddof 0 the
          population std; a group of one has std 0 under either
  drgrpo: r - mean_g                      (Dr. GRPO: no std normalisation)
  rloo:   r_i - mean of the OTHER members of i's group (0 for a group of one)
  A group whose rewards are all equal gets 0 in every mode.

  Args:
    rewards: float [N].
    groups: int [N] group ids (arbitrary, need not be contiguous or sorted).
    mode: one of ADV_MODES.
    eps: grpo's std guard, >= 0.
    ddof: grpo's std degrees of freedom, 0 or 1.

  Returns:
    float32 [N].
  """
  if mode not in ADV_MODES:
    raise ValueError(f"mode = {mode!r}: allowed one of {ADV_MODES}")
  if not (is_number(eps) and np.isfinite(eps) and eps >= 0):
    raise ValueError(f"eps = {eps!r}: allowed a finite float >= 0")
  if isinstance(ddof, bool) or ddof not in (0, 1):
    raise ValueError(f"ddof = {ddof!r}: allowed 0 or 1")
  r, g = _rewards_groups(rewards, groups)
  count = np.bincount(g).astype(np.float64)
  total = np.bincount(g, weights=r)
  mean = total / count
  # All-equal groups are exactly 0: the float mean of equal values can differ from them
  # by rounding (0.1 x 3), which grpo's std would blow up (to +-0.8 or 0/0 at eps 0).
  signal = signal_mask(r, g)
  centred = np.where(signal, r - mean[g], 0.0)
  if mode == "drgrpo":
    out = centred
  elif mode == "grpo":
    std = np.sqrt(np.bincount(g, weights=centred**2) / np.maximum(count - ddof, 1))
    out = centred / np.where(signal, std[g] + eps, 1.0)
  else:
    n = count[g]
    others = (total[g] - r) / np.maximum(n - 1, 1)
    out = np.where(signal & (n > 1), r - others, 0.0)
  return out.astype(np.float32)


def signal_mask(rewards, groups) -> np.ndarray:
  """bool [N]: False for every member of a group whose rewards are all equal.

  Such groups have zero advantage everywhere (no learning signal); DAPO's dynamic sampling
  drops them. A group of one is always all-equal.
  """
  r, g = _rewards_groups(rewards, groups)
  n_groups = int(g.max()) + 1 if g.size else 0
  lo = np.full(n_groups, np.inf)
  hi = np.full(n_groups, -np.inf)
  np.minimum.at(lo, g, r)
  np.maximum.at(hi, g, r)
  return (hi > lo)[g]


def overlong_penalty(lengths, *, max_len: int, buffer: int, factor: float = 1.0) -> np.ndarray:
  """DAPO soft overlong punishment, added to the reward.

  0 for L <= max_len - buffer; ((max_len - buffer) - L) / buffer * factor inside the last
  `buffer` tokens (linear from 0 down to -factor at L = max_len); -factor beyond max_len.
  buffer == 0 turns the shaping off (all zeros).

  Args:
    lengths: int [N] generated tokens per episode, >= 0.
    max_len: int > 0.
    buffer: int in [0, max_len].
    factor: float >= 0, the largest penalty.

  Returns:
    float32 [N], in [-factor, 0].
  """
  if not is_int(max_len) or max_len <= 0:
    raise ValueError(f"max_len = {max_len!r}: allowed an int > 0")
  if not is_int(buffer) or not 0 <= buffer <= max_len:
    raise ValueError(f"buffer = {buffer!r}: allowed an int in [0, max_len={max_len}]")
  if not (is_number(factor) and np.isfinite(factor) and factor >= 0):
    raise ValueError(f"factor = {factor!r}: allowed a finite float >= 0")
  length = np.asarray(lengths)
  if length.ndim != 1 or not np.issubdtype(length.dtype, np.integer) or np.any(length < 0):
    raise ValueError(f"lengths: allowed a 1-D int array [N] of values >= 0, got shape "
                     f"{length.shape} dtype {length.dtype}")
  if buffer == 0:
    return np.zeros(length.shape, np.float32)
  start = max_len - buffer
  ramp = (start - length.astype(np.float64)) / buffer * factor
  out = np.where(length <= start, 0.0, np.where(length <= max_len, ramp, -float(factor)))
  return out.astype(np.float32)


# ---------------------------------------------------------------------------- token level

def _check_bt(**arrays) -> tuple[int, int]:
  """All arrays share one [B, T] shape; returns it."""
  shapes = {name: tuple(jnp.shape(a)) for name, a in arrays.items()}
  first = next(iter(shapes.values()))
  if len(first) != 2 or any(s != first for s in shapes.values()):
    raise ValueError(f"{', '.join(shapes)}: allowed equal [B, T] shapes, got {shapes}")
  return first


def _check_adv(adv, batch: int, name: str = "adv") -> None:
  if tuple(jnp.shape(adv)) != (batch,):
    raise ValueError(f"{name}: allowed shape [B] = ({batch},), got {tuple(jnp.shape(adv))}")


def _check_eps(eps_low: float, eps_high: float) -> None:
  if not (is_number(eps_low) and 0 <= eps_low < 1):
    raise ValueError(f"eps_low = {eps_low!r}: allowed a python float in [0, 1)")
  if not (is_number(eps_high) and 0 <= eps_high < float("inf")):
    raise ValueError(f"eps_high = {eps_high!r}: allowed a finite python float >= 0")


def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
  """num / den where den > 0, else 0 (no NaN in the value or the gradient)."""
  ok = den > 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def aggregate(values, mask, mode: str, *, norm_len: Optional[int] = None) -> jax.Array:
  """Reduces per-token values [B, T] to a scalar over the masked tokens (loss_agg_mode).

  token-mean:              sum(v m) / sum(m)                    (0 when sum(m) = 0)
  seq-mean-token-mean:     mean over rows with sum_t m > 0 of sum_t(v m) / sum_t m
                           (0 when no row has a token)
  seq-mean-token-sum-norm: sum(v m) / (B * norm_len), norm_len defaults to T (Dr. GRPO)

  Args:
    values: float [B, T].
    mask: float [B, T] in {0, 1}.
    mode: one of AGG_MODES.
    norm_len: int > 0, only for seq-mean-token-sum-norm.

  Returns:
    float32 scalar, never NaN for finite values at masked positions.
  """
  if mode not in AGG_MODES:
    raise ValueError(f"mode = {mode!r}: allowed one of {AGG_MODES}")
  batch, length = _check_bt(values=values, mask=mask)
  if norm_len is not None and not (is_int(norm_len) and norm_len > 0):
    raise ValueError(f"norm_len = {norm_len!r}: allowed None or an int > 0")
  m = _f32(mask)
  vm = jnp.where(m > 0, _f32(values) * m, 0.0)
  if mode == "token-mean":
    return _safe_div(vm.sum(), m.sum())
  if mode == "seq-mean-token-mean":
    count = m.sum(axis=1)
    per_row = _safe_div(vm.sum(axis=1), count)
    return _safe_div(per_row.sum(), (count > 0).sum().astype(jnp.float32))
  return vm.sum() / float(batch * (norm_len if norm_len is not None else length))


def clipped_token_loss(lp, lp_old, adv, *, eps_low: float,
                       eps_high: float) -> tuple[jax.Array, jax.Array]:
  """PPO-style clipped surrogate with clip-higher (DAPO: eps_low 0.2, eps_high 0.28).

  rho = exp(lp - lp_old); l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A).

  Args:
    lp, lp_old: float32 [B, T].
    adv: float32 [B], one advantage per row.
    eps_low: in [0, 1). eps_high: >= 0.

  Returns:
    loss float32 [B, T] (unmasked: aggregate it), clipped bool [B, T]: the clipped term is
    the active one and differs from the unclipped one (its gradient is 0 there).
  """
  _check_eps(eps_low, eps_high)
  batch, _ = _check_bt(lp=lp, lp_old=lp_old)
  _check_adv(adv, batch)
  a = _f32(adv)[:, None]
  rho = jnp.exp(_f32(lp) - _f32(lp_old))
  plain = rho * a
  clipped = jnp.clip(rho, 1.0 - eps_low, 1.0 + eps_high) * a
  return -jnp.minimum(plain, clipped), clipped < plain


def gspo_token_loss(lp, lp_old, mask, adv, *, eps_low: float,
                    eps_high: float) -> tuple[jax.Array, jax.Array]:
  """GSPO: the clip acts on the sequence ratio, gradients flow per token.

  s_i = exp(sum_t m (lp - lp_old) / sum_t m)   (rows without a masked token: s_i = 1)
  s_it = sg(s_i) * exp(lp_t - sg(lp_t))        (value s_i; d s_it / d lp_t = s_i)
  l_it = -min(s_it A_i, clip(s_it, 1 - eps_low, 1 + eps_high) A_i)
  Aggregated with seq-mean-token-mean, the gradient of an unclipped row is the sequence-
  level GSPO gradient -A_i s_i mean_t(grad lp_t) / rows.

  Args:
    lp, lp_old, mask: float32 [B, T].
    adv: float32 [B].
    eps_low: in [0, 1). eps_high: >= 0 (GSPO's ranges are small, e.g. 3e-4 / 4e-4).

  Returns:
    loss float32 [B, T], clipped bool [B] (the row's clipped term is active and differs).
  """
  _check_eps(eps_low, eps_high)
  batch, _ = _check_bt(lp=lp, lp_old=lp_old, mask=mask)
  _check_adv(adv, batch)
  lp = _f32(lp)
  m = _f32(mask)
  a = _f32(adv)
  log_ratio = jnp.where(m > 0, (lp - _f32(lp_old)) * m, 0.0)
  s = jnp.exp(_safe_div(log_ratio.sum(axis=1), m.sum(axis=1)))
  s_tok = jax.lax.stop_gradient(s)[:, None] * jnp.exp(lp - jax.lax.stop_gradient(lp))
  plain = s_tok * a[:, None]
  clipped = jnp.clip(s_tok, 1.0 - eps_low, 1.0 + eps_high) * a[:, None]
  row_clipped = jnp.clip(s, 1.0 - eps_low, 1.0 + eps_high) * a < s * a
  return -jnp.minimum(plain, clipped), row_clipped


def opmd_seq_loss(lp, lp_old, mask, centered_reward, *, tau: float) -> jax.Array:
  """Kimi k1.5 online policy mirror descent, one squared regression per sequence.

  l_i = 0.5 * (c_i - tau * sum_t m (lp - lp_old))^2, c_i = r_i - mean_g r (host side:
  advantages(mode="drgrpo")). Average the rows yourself (e.g. over rows with signal).

  Args:
    lp, lp_old, mask: float32 [B, T].
    centered_reward: float32 [B].
    tau: > 0, the KL regularisation strength.

  Returns:
    float32 [B].
  """
  if not (is_number(tau) and 0 < tau < float("inf")):
    raise ValueError(f"tau = {tau!r}: allowed a finite python float > 0")
  batch, _ = _check_bt(lp=lp, lp_old=lp_old, mask=mask)
  _check_adv(centered_reward, batch, "centered_reward")
  m = _f32(mask)
  log_ratio = jnp.where(m > 0, (_f32(lp) - _f32(lp_old)) * m, 0.0).sum(axis=1)
  return 0.5 * jnp.square(_f32(centered_reward) - tau * log_ratio)


def kl_tokens(lp, lp_ref, kind: str) -> jax.Array:
  """Per-token KL(pi || pi_ref) estimates on samples of pi.

  k1: lp - lp_ref (unbiased, can be negative);
  k3: exp(lp_ref - lp) - (lp_ref - lp) - 1 (unbiased, >= 0; computed with expm1, so it is
  exactly 0 at equality and never negative by rounding).

  Args:
    lp, lp_ref: float32 [B, T].
    kind: one of KL_KINDS.

  Returns:
    float32 [B, T].
  """
  if kind not in KL_KINDS:
    raise ValueError(f"kind = {kind!r}: allowed one of {KL_KINDS}")
  _check_bt(lp=lp, lp_ref=lp_ref)
  if kind == "k1":
    return _f32(lp) - _f32(lp_ref)
  d = _f32(lp_ref) - _f32(lp)
  return jnp.maximum(jnp.expm1(d) - d, 0.0)


def entropy_from_logits(logits) -> jax.Array:
  """Entropy of softmax(logits) per position, in nats (a metric).

  Args:
    logits: [B, T, V], any float dtype; -inf entries (excluded tokens) count as p = 0.

  Returns:
    float32 [B, T].
  """
  if jnp.ndim(logits) != 3:
    raise ValueError(f"logits: allowed shape [B, T, V], got {tuple(jnp.shape(logits))}")
  logp = jax.nn.log_softmax(_f32(logits), axis=-1)
  p = jnp.exp(logp)
  return -jnp.where(p > 0, p * logp, 0.0).sum(axis=-1)


def ratio_stats(lp, lp_old, mask) -> dict[str, jax.Array]:
  """Metrics of rho = exp(lp - lp_old) over the masked tokens (no gradient).

  Returns:
    float32 scalars: ratio_mean, ratio_max, ratio_min (1.0 when no token is masked) and
    approx_kl, the token-mean of k3 with lp_old as the sampling policy: rho - 1 - log rho,
    an estimate of KL(pi_old || pi).
  """
  _check_bt(lp=lp, lp_old=lp_old, mask=mask)
  lp = jax.lax.stop_gradient(_f32(lp))
  lp_old = jax.lax.stop_gradient(_f32(lp_old))
  m = _f32(mask)
  on = m > 0
  any_on = on.any()
  rho = jnp.exp(lp - lp_old)
  mean = jnp.where(any_on, _safe_div(jnp.where(on, rho * m, 0.0).sum(), m.sum()), 1.0)
  return {
      "ratio_mean": mean,
      "ratio_max": jnp.where(any_on, jnp.where(on, rho, -jnp.inf).max(), 1.0),
      "ratio_min": jnp.where(any_on, jnp.where(on, rho, jnp.inf).min(), 1.0),
      "approx_kl": aggregate(kl_tokens(lp_old, lp, "k3"), m, "token-mean"),
  }
