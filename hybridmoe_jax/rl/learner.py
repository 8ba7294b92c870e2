"""The jitted RL policy update over the pre-training TrainState (DESIGN s9).

`make_rl_step(graphdef, cfg, tx, rl, schedule, sampling)` returns `rl_step(state, batch,
lp_ref, routes) -> (state, metrics)`: one optimizer step on one minibatch of `rl/batch.py`
arrays ([R, T]). The training forward recomputes per-token log-probs of the sampled targets
(fp32) under the policy that is sampled: `sampling_logps` applies the rollout's sampling
transform (infer.sampling.sampling_logits: vocabulary limit, temperature, top-k / top-p
nucleus, renormalised) to the current logits, so lp and the rollout's behaviour log-probs
(lp_old, recorded with the same function) are log-probs of one family of distributions and
the ratio is exactly 1 on-policy. A target outside the current policy's nucleus has
probability 0; its log-prob is floored at LOGP_FLOOR (finite losses; its gradient is 0
either way). Then the `rl.loss` (clip, gspo with its own gspo_eps_* range, opmd:
DESIGN s9's exact forms, rl/losses.py) aggregated by `rl.loss_agg_mode` (opmd: mean over rows
holding an episode; seq-mean-token-sum-norm divides by R x rl.max_tokens, so padding never
changes the loss), plus kl_beta * agg(kl_t) when `rl.kl` is set. Gradients go to params
only; clipping is the optimizer's (`train.clip`). The routing biases stay frozen unless
`rl.update_biases`. A step whose loss or gradient is not finite is skipped.

Rollout vs learner log-probs: the rollout decodes token by token (KDA recurrence, MLA
absorbed over the cache), the learner runs the chunked KDA and the expanded MLA: the same
math in other fp32 summation orders, within 1.2e-5 on configs/rl_tiny.py at random init
(tests/rl/test_learner.py, slow: bound 2e-5; most of it is chunked vs recurrent KDA), so
on-policy ratios are 1 to ~1e-5, far inside every clip range.

`token_logps(graphdef, sampling)` is the jitted forward that gives lp [R, T] (and, for
routing replay, the routed experts of every MoE layer) for the reference policy and the
rollout policy.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.infer.sampling import SamplingConfig, sampling_logits
from hybridmoe_jax.rl import losses
from hybridmoe_jax.ops.plan import ExecutionPlan, execution_plan
from hybridmoe_jax.config.rl import RLConfig
from hybridmoe_jax.train import optim
from hybridmoe_jax.train import step as step_lib
from hybridmoe_jax.train.state import TrainState
from hybridmoe_jax.ops.cross_entropy import token_nll
from hybridmoe_jax.train.step import next_token_targets


# ln of the smallest probability a policy log-prob takes (e^-80 ~ 1.8e-35): a target outside
# the nucleus (probability 0) gets it, so ratios are ~0 instead of NaN and OPMD / k3 stay
# finite. Sampled tokens are never near it (they were drawn).
LOGP_FLOOR = -80.0


def target_logps(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """logits [R, T, V] (any float), tokens int32 [R, T] -> float32 [R, T]: log-softmax at
  token t + 1 for position t (0 at the last column): the pre-training step's shifted
  targets and per-token NLL, negated."""
  targets, _ = next_token_targets(tokens, jnp.ones_like(tokens))
  return -token_nll(logits, targets)


def sampling_dist(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """logits [R, T, V] -> fp32 logits of the distribution `sampling` draws from (removed ids
  at -1e30). With top_k 0 and top_p 1 the filter is the identity
  (infer.sampling.filter_logits), so its sort over V is skipped."""
  if not sampling.temperature > 0:
    raise ValueError(f"sampling.temperature = {sampling.temperature}: allowed > 0 (a greedy "
                     "policy has no log-prob gradient)")
  temperature, top_k, top_p, vocab_limit = sampling.as_arrays()
  if sampling.top_k == 0 and sampling.top_p >= 1.0:
    ids = jnp.arange(logits.shape[-1])
    return jnp.where((vocab_limit <= 0) | (ids < vocab_limit), logits.astype(jnp.float32),
                     -1e30) / temperature
  return sampling_logits(logits, temperature, top_k, top_p, vocab_limit)


def sampling_logps(logits: jax.Array, tokens: jax.Array, sampling: SamplingConfig
                   ) -> jax.Array:
  """target_logps under the distribution `sampling` draws from, floored at LOGP_FLOOR:
  logits [R, T, V], tokens int32 [R, T] -> float32 [R, T]."""
  return jnp.maximum(target_logps(sampling_dist(logits, sampling), tokens), LOGP_FLOOR)


def _forward(graphdef, params, biases, rest, tokens, segment_ids, routes=None,
             record_routes=False):
  model = nnx.merge(graphdef, params, jax.lax.stop_gradient(biases), rest)
  return model(tokens, segment_ids=segment_ids, routes=routes, record_routes=record_routes)


def token_logps(graphdef, sampling: SamplingConfig, *, record_routes: bool = False,
                plan: ExecutionPlan | None = None) -> Callable:
  """jitted (params, biases, rest, tokens [R,T], segment_ids [R,T]) -> lp [R,T] fp32 (under
  the `sampling` distribution: sampling_logps), or (lp, routes) with record_routes (routes:
  {MoE layer index: int32 [R, T, k]}); traced under `plan` (the training runtime's)."""

  @jax.jit
  @execution_plan(plan)
  def fn(params, biases, rest, tokens, segment_ids):
    logits, aux = _forward(graphdef, params, biases, rest, tokens, segment_ids,
                           record_routes=record_routes)
    lp = sampling_logps(logits, tokens, sampling)
    return (lp, aux["routes"]) if record_routes else lp

  return fn


def policy_objective(lp, batch: dict, rl: RLConfig, lp_ref=None, logits=None
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The scalar RL loss of one minibatch and its metrics (see the module docstring).

  lp: float32 [R, T] the current policy's log-probs of the targets; batch: rl/batch.py
  arrays; lp_ref: [R, T] the reference policy's, for the KL term; logits [R, T, V]: of the
  sampled distribution (sampling_dist), for the entropy metric only (no gradient).
  """
  mask, adv = batch["mask"], batch["advantage"]
  lp_old = jnp.maximum(batch["lp_old"], LOGP_FLOOR)
  lp = jnp.where(mask > 0, lp, 0.0)   # padding and prompt tokens: exactly 0 (no NaN paths)
  # Dr. GRPO's normaliser: a constant generation budget, never the padded length
  norm_len = rl.max_tokens if rl.loss_agg_mode == "seq-mean-token-sum-norm" else None
  metrics = {}
  if rl.loss == "clip":
    tok, clipped = losses.clipped_token_loss(lp, lp_old, adv, eps_low=rl.eps_low,
                                             eps_high=rl.eps_high)
    loss = losses.aggregate(tok, mask, rl.loss_agg_mode, norm_len=norm_len)
    metrics["clip_fraction"] = losses.aggregate(clipped.astype(jnp.float32), mask,
                                                "token-mean")
  elif rl.loss == "gspo":
    tok, clipped = losses.gspo_token_loss(lp, lp_old, mask, adv, eps_low=rl.gspo_eps_low,
                                          eps_high=rl.gspo_eps_high)
    loss = losses.aggregate(tok, mask, rl.loss_agg_mode, norm_len=norm_len)
    rows = (jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
    metrics["clip_fraction"] = jnp.sum(clipped * rows) / jnp.maximum(jnp.sum(rows), 1.0)
  else:  # opmd
    per_row = losses.opmd_seq_loss(lp, lp_old, mask, batch["centered"], tau=rl.opmd_tau)
    rows = batch["valid"]
    loss = jnp.sum(per_row * rows) / jnp.maximum(jnp.sum(rows), 1.0)
    metrics["clip_fraction"] = jnp.zeros((), jnp.float32)
  metrics["policy_loss"] = loss
  if lp_ref is not None and rl.kl != "none":
    kl = losses.kl_tokens(lp, jnp.where(mask > 0, lp_ref, 0.0), rl.kl)
    kl = losses.aggregate(kl, mask, rl.loss_agg_mode, norm_len=norm_len)
    metrics["kl_ref"] = kl
    loss = loss + rl.kl_beta * kl
  metrics.update(losses.ratio_stats(jax.lax.stop_gradient(lp), lp_old, mask))
  if logits is not None:
    ent = losses.entropy_from_logits(jax.lax.stop_gradient(logits))
    metrics["entropy"] = losses.aggregate(ent, mask, "token-mean")
  metrics["loss"] = loss
  return loss, metrics


def make_rl_step(graphdef: nnx.GraphDef, cfg: ModelConfig, tx: optax.GradientTransformation,
                 rl: RLConfig, schedule: optax.Schedule, sampling: SamplingConfig, *,
                 mesh: jax.sharding.Mesh | None = None, state_shardings=None,
                 plan: ExecutionPlan | None = None
                 ) -> Callable[..., tuple[TrainState, dict[str, Any]]]:
  """The jitted `rl_step(state, batch, lp_ref, routes) -> (state, metrics)`; `state` is
  donated: the pre-training step (train/step.py make_train_step: optimizer, clipping,
  skipped non-finite updates, mesh placement) with the RL objective swapped in as its loss
  and the routing biases frozen unless rl.update_biases. sampling: the rollouts' (vocab_limit
  resolved: Rollout.config.sampling), the policy being trained. batch: host (numpy) arrays
  of rl/batch.py; lp_ref: [R, T] (under the same sampling) or None; routes: the rollout
  policy's routed experts (routing replay) or None. `mesh` / `state_shardings` / `plan`: the
  pre-training runtime's."""

  def loss_fn(params, state: TrainState, batch, lp_ref, routes):
    logits, aux = _forward(graphdef, params, state.biases, state.rest, batch["tokens"],
                           batch["segment_ids"], routes=routes)
    dist = sampling_dist(logits, sampling)
    lp = jnp.maximum(target_logps(dist, batch["tokens"]), LOGP_FLOOR)
    loss, metrics = policy_objective(lp, batch, rl, lp_ref, dist)
    metrics["tokens"] = jnp.sum(batch["mask"])
    return loss, (aux.get("moe", {}), metrics)

  step = step_lib.make_train_step(graphdef, cfg, tx, grad_accum=1, schedule=schedule,
                                  mesh=mesh, state_shardings=state_shardings, plan=plan,
                                  loss_fn=loss_fn, update_biases=rl.update_biases)

  def rl_step(state: TrainState, batch: dict, lp_ref, routes):
    state, metrics = step(state, batch, lp_ref, routes)
    metrics.pop("moe")       # per-layer routing stats: the pre-training monitor's
    return state, metrics

  return rl_step


def rl_schedule(rl: RLConfig, lr: float, warmup: int, sft_steps: int) -> optax.Schedule:
  """The learning rate by applied update (train/optim.py's piecewise schedule): `sft_steps`
  SFT steps at rl.sft_learning_rate (10-step linear warmup: (n + 1) / 10 of it at update n),
  then RL updates at `lr` after a linear warmup of `warmup` ((k + 1) / warmup)."""

  def constant(start, steps, peak, ramp):
    return optim.LRPiece(start=start, steps=steps, lr_from=peak / max(ramp, 1), lr=peak,
                         warmup=max(ramp, 1) - 1, schedule="constant", min_lr_ratio=1.0,
                         decay_fraction=0.0)

  pieces = [constant(0, sft_steps, rl.sft_learning_rate, 10)] if sft_steps else []
  return optim.make_schedule(pieces + [constant(sft_steps, max(warmup, 1), lr, warmup)])
