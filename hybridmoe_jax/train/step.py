"""The jitted train and eval steps (pure functions of the state pytree and a batch).

Batch: tokens, segment_ids int32 [B, T] (segment id 0 = padding), optionally loss_weights
float32 [B, T] (the weight of each token as a target, e.g. 0 on prompts and 1 on answers of
Q/A documents; data/multimodal.py). The loss is the weighted mean of next-token
cross-entropy in fp32 over targets inside the same segment; gradients flow to `params` only.
Held-out evaluation ignores loss_weights (plain per-token NLL, comparable across runs).
After the optimizer update, every MoE layer's routing bias is recomputed from this step's
routing statistics (summed over microbatches; `layers.balancing`) and used from the next
step on. metrics["moe"] = {MoE module path, e.g. "layers/1/ffn": `balancing.layer_metrics`}.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hybridmoe_jax.config import sharding
from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.data.tokenizers.byte import IMAGE_IDS
from hybridmoe_jax.layers.balancing import update_routing_biases
from hybridmoe_jax.model.stack import unstacked_name
from hybridmoe_jax.ops.plan import ExecutionPlan, execution_plan
from hybridmoe_jax.parallel import mesh as mesh_lib
from hybridmoe_jax.train import optim
from hybridmoe_jax.train.state import TrainState

Batch = dict[str, jax.Array]
# Optional vision keys of a batch, passed to the model as keyword arguments (DESIGN s5).
IMAGE_BATCH_KEYS = ("images", "image_grid", "image_index")
MODEL_INPUT_KEYS = ("tokens", "segment_ids") + IMAGE_BATCH_KEYS
# What the train step reads: the model inputs and the optional per-token target weights.
LOSS_WEIGHTS = "loss_weights"
TRAIN_INPUT_KEYS = MODEL_INPUT_KEYS + (LOSS_WEIGHTS,)


def model_inputs(batch: dict, keys: tuple[str, ...] = MODEL_INPUT_KEYS) -> dict:
  """The entries of `batch` a step reads (others, such as positions, stay on the host)."""
  return {k: batch[k] for k in keys if k in batch}


def next_token_targets(tokens: jax.Array, segment_ids: jax.Array):
  """-> targets [B, T] (tokens shifted left by one), weights [B, T] fp32.

  Position t predicts token t + 1 only if both are real tokens of the same segment.
  """
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  nxt = jnp.concatenate([segment_ids[:, 1:], jnp.zeros_like(segment_ids[:, :1])], axis=1)
  weights = (segment_ids > 0) & (nxt == segment_ids)
  return targets, weights.astype(jnp.float32)


def _forward_nll(graphdef, params, biases, rest, tokens, segment_ids, extras=None,
                 image_ids=IMAGE_IDS):
  """-> (weighted NLL sum, (weight sum, routing stats)).

  extras: the image keys of a vision batch (images, image_grid, image_index) and/or
  loss_weights [B, T] (per target token), else {}.
  image_ids: the tokenizer's image_start / image_end / image_pad ids, never targets in a
  batch with images (default: the byte tokenizer's).
  """
  model = nnx.merge(graphdef, params, jax.lax.stop_gradient(biases), rest)
  extras = dict(extras or {})
  loss_weights = extras.pop(LOSS_WEIGHTS, None)
  # The last hidden state, not the logits: the loss takes the head block by block and never
  # holds the [B, T, V] fp32 logits (`ops.cross_entropy`).
  hidden, aux = model(tokens, segment_ids=segment_ids, return_hidden=True, **extras)
  targets, weights = next_token_targets(tokens, segment_ids)
  if "images" in extras and image_ids:  # no loss on image placeholders, delimiters (DESIGN s5)
    weights = weights * ~jnp.isin(targets, jnp.asarray(image_ids, jnp.int32))
  if loss_weights is not None:  # position t predicts token t + 1: take that token's weight
    weights = weights * jnp.concatenate(
        [loss_weights[:, 1:], jnp.zeros_like(loss_weights[:, :1])], axis=1).astype(jnp.float32)
  nll = model.lm_head.nll(hidden, targets)
  nll_sum = jnp.sum(nll * weights)
  return nll_sum, (jnp.sum(weights), aux.get("moe", {}))


def _microbatches(x: jax.Array, n: int) -> jax.Array:
  """[B, ...] -> [n, B / n, ...], microbatch i = rows i, i + n, ...: each device's block of
  rows (the batch is split in contiguous blocks over the batch axes) holds its share of
  every microbatch, so splitting needs no exchange when B / devices divides by n (a
  contiguous split would move whole microbatches between devices). The loss sums every
  microbatch, so their composition does not matter."""
  return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def _grads_and_stats(graphdef, state: TrainState, tokens, segment_ids, grad_accum: int,
                     extras=None, image_ids=IMAGE_IDS, unroll: int = 1):
  """Sum of NLL, gradient of that sum, token count and routing stats over microbatches."""
  grad_fn = jax.value_and_grad(_forward_nll, argnums=1, has_aux=True)
  extras = extras or {}

  def one(toks, segs, ext):
    (nll, (count, stats)), grads = grad_fn(graphdef, state.params, state.biases, state.rest,
                                           toks, segs, ext, image_ids)
    return nll, count, stats, grads

  if grad_accum == 1:
    return one(tokens, segment_ids, extras)
  toks, segs = _microbatches(tokens, grad_accum), _microbatches(segment_ids, grad_accum)
  exts = jax.tree.map(lambda x: _microbatches(x, grad_accum), extras)
  shapes = jax.eval_shape(one, toks[0], segs[0], jax.tree.map(lambda x: x[0], exts))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def body(carry, xs):
    return jax.tree.map(jnp.add, carry, one(*xs)), None

  total, _ = jax.lax.scan(body, zeros, (toks, segs, exts), unroll=unroll)
  return total


def _where(ok, new, old):
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def _on_mesh(fn, mesh, batch_arg: int):
  """Run jitted `fn` under `jax.set_mesh(mesh)` with argument `batch_arg` (a dict of host
  arrays: this process's rows) placed on the mesh, batch dimension over (data, fsdp)."""
  def call(*args):
    args = list(args)
    args[batch_arg] = mesh_lib.host_batch_to_global(args[batch_arg], mesh)
    with jax.set_mesh(mesh):
      return fn(*args)

  return call


# A swapped-in loss: loss_fn(params, state, batch, *extra) -> (scalar loss, (routing stats,
# metrics)), differentiated w.r.t. params (e.g. the RL objective, rl/learner.py).
LossFn = Callable[..., tuple[jax.Array, tuple[dict, dict[str, Any]]]]


def make_train_step(graphdef: nnx.GraphDef, cfg: ModelConfig,
                    tx: optax.GradientTransformation, *, grad_accum: int,
                    schedule: optax.Schedule, mesh: jax.sharding.Mesh | None = None,
                    state_shardings=None, image_ids: tuple[int, ...] = IMAGE_IDS,
                    loss_fn: LossFn | None = None, update_biases: bool = True,
                    plan: ExecutionPlan | None = None, accum_unroll: int = 1
                    ) -> Callable[..., tuple[TrainState, dict[str, Any]]]:
  """The jitted `train_step(state, batch, *extra) -> (state, metrics)`; `state` is donated.

  The loss: by default the pre-training one (token NLL, mean over the target tokens; with
  grad_accum microbatches, dividing the batch, summed). `loss_fn` swaps it (grad_accum must
  be 1): loss_fn(params, state, batch, *extra) -> (loss, (routing stats, metrics)); its
  metrics join the step's. The rest is one update for every caller: global-norm clipping
  and the optimizer (`tx`), the QB routing-bias rule on the step's routing stats (unless
  `update_biases` is False: biases frozen), a non-finite loss / gradient / update skipped.
  `schedule` maps applied updates to the learning rate (the optimizer's, reported as a
  metric). With `mesh`, the step runs under that mesh (host batches placed over data x
  fsdp) and the new state is constrained to `state_shardings` (the input layout); `plan`
  (`Runtime.plan`: context-parallel mixers, expert-parallel MoE) is entered inside the
  traced function, so each step function compiles its own plan. `image_ids`:
  the run tokenizer's image ids (no loss on them). `accum_unroll`: microbatches per
  iteration of the accumulation loop (tools/aot.py compiles 1 and 2 to cost the loop).
  """
  if loss_fn is not None and grad_accum != 1:
    raise ValueError(f"grad_accum = {grad_accum}: allowed 1 with a swapped-in loss_fn")

  def pretrain_grads(state: TrainState, batch: Batch):
    tokens, segment_ids = batch["tokens"], batch["segment_ids"]
    tokens = sharding.constrain(tokens, ("batch", "length"))
    segment_ids = sharding.constrain(segment_ids, ("batch", "length"))
    extras = model_inputs(batch, IMAGE_BATCH_KEYS + (LOSS_WEIGHTS,))
    nll, count, stats, grads = _grads_and_stats(graphdef, state, tokens, segment_ids,
                                                grad_accum, extras, tuple(image_ids),
                                                accum_unroll)
    denom = jnp.maximum(count, 1.0)
    # tokens: summed target weights (= target tokens without loss_weights)
    return nll / denom, jax.tree.map(lambda g: g / denom, grads), stats, {"tokens": count}

  def swapped_grads(state: TrainState, batch: Batch, *extra):
    (loss, (stats, metrics)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, state, batch, *extra)
    return loss, grads, stats, metrics

  def train_step(state: TrainState, batch: Batch, *extra):
    loss, grads, stats, loss_metrics = (pretrain_grads(state, batch) if loss_fn is None
                                        else swapped_grads(state, batch, *extra))
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A finite gradient can still give a non-finite update (moments overflowing at a huge
    # lr), and a state that took one never recovers: such a step is skipped too.
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(optax.tree.norm(params))
    biases, moe_metrics = (update_routing_biases(state.biases, stats, cfg.moe,
                                                 layer_name=functools.partial(
                                                     unstacked_name, cfg))
                           if update_biases else (state.biases, {}))
    applied = state.step - state.skipped
    new_rng, _ = jax.random.split(state.rng)
    new_state = state.replace(
        step=state.step + 1,
        params=_where(ok, params, state.params),
        opt_state=_where(ok, opt_state, state.opt_state),
        biases=_where(ok, biases, state.biases),
        rng=new_rng,
        skipped=state.skipped + (~ok).astype(jnp.int32))
    if state_shardings is not None:
      new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
    metrics = {
        **loss_metrics,
        "loss": loss, "grad_norm": grad_norm, "lr": optim.learning_rate(schedule, applied),
        "finite": ok, "skipped": new_state.skipped,
        "moe": moe_metrics,
    }
    return new_state, metrics

  step = jax.jit(execution_plan(plan)(train_step), donate_argnums=0)
  return step if mesh is None else _on_mesh(step, mesh, batch_arg=1)


def make_eval_step(graphdef: nnx.GraphDef, *, mesh: jax.sharding.Mesh | None = None,
                   image_ids: tuple[int, ...] = IMAGE_IDS, plan: ExecutionPlan | None = None
                   ) -> Callable[..., tuple[jax.Array, jax.Array]]:
  """The jitted `eval_step(params, biases, batch, rest) -> (sum_nll, num_tokens)`, traced
  under `plan` (as `make_train_step`)."""

  def eval_step(params, biases, batch: Batch, rest):
    nll, (count, _) = _forward_nll(graphdef, params, biases, rest, batch["tokens"],
                                   batch["segment_ids"],
                                   model_inputs(batch, IMAGE_BATCH_KEYS), tuple(image_ids))
    return nll, count

  step = jax.jit(execution_plan(plan)(eval_step))
  return step if mesh is None else _on_mesh(step, mesh, batch_arg=2)
