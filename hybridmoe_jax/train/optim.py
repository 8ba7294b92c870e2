"""The learning-rate schedule and the optimizer (global-norm clipping, then AdamW or Muon).

One scheduler for every run: the plan (train/stage_plan.py) gives one `LRPiece` per stage (a run
without a curriculum is one stage) and `make_schedule` is their piecewise function of the
global step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from hybridmoe_jax.config.run import TrainConfig
from hybridmoe_jax.config.sharding import path_string
from hybridmoe_jax.model.stack import stacked_position
from hybridmoe_jax.train.muon import muon


@dataclasses.dataclass(frozen=True)
class LRPiece:
  """The learning rate of one stage: global steps [start, start + steps)."""

  start: int
  steps: int
  lr_from: float        # warmup start value
  lr: float             # peak
  warmup: int           # linear warmup steps (<= steps)
  schedule: str         # "constant", "linear", "cosine" or "wsd"
  min_lr_ratio: float   # end value / lr
  decay_fraction: float  # wsd: share of the steps in the final linear decay


def piece_value(p: LRPiece, local_step, xp=math):
  """Learning rate of one piece at `local_step` steps into its stage.

  Linear from p.lr_from to p.lr over p.warmup steps, then over the remaining
  d = steps - warmup steps (n = steps since the warmup, clamped to [0, d]), with
  end = lr * min_lr_ratio:
    constant  lr
    linear    linear from lr to end over d steps
    cosine    lr * ((1 - min_lr_ratio) * (1 + cos(pi * n / d)) / 2 + min_lr_ratio)
    wsd       lr until the last decay_fraction * steps, then linear to end
  Written in optax's operation order (linear_schedule, cosine_decay_schedule), so a plain
  run's float32 learning rates are those of the optax warmup-cosine / wsd schedules.
  `xp` is `math` (Python floats) or `jax.numpy` (traced steps).
  """
  lr, m, w = p.lr, p.min_lr_ratio, p.warmup
  clip = (lambda v, a, b: min(max(v, a), b)) if xp is math else jnp.clip
  where = (lambda c, a, b: a if c else b) if xp is math else jnp.where

  def ramp(start, end, n, length):  # linear from start to end over `length` steps
    return (start - end) * (1 - clip(n, 0, length) / length) + end

  d = max(p.steps - w, 1)
  if p.schedule == "wsd":
    decay = min(int(round(p.steps * p.decay_fraction)), p.steps - w)
    since = local_step - (p.steps - decay)
    main = where(since < 0, lr + 0.0 * since, ramp(lr, lr * m, since, max(decay, 1)))
  elif p.schedule == "linear":
    main = ramp(lr, lr * m, local_step - w, d)
  elif p.schedule == "cosine":
    n = clip(local_step - w, 0, d)
    main = lr * ((1 - m) * (0.5 * (1 + xp.cos(math.pi * n / d))) + m)
  else:
    main = lr + 0.0 * local_step
  return where(local_step < w, ramp(p.lr_from, lr, local_step, max(w, 1)), main)


def make_schedule(pieces: Sequence[LRPiece]) -> optax.Schedule:
  """Global step -> the learning rate of the piece it falls in (the last one holds on)."""
  pieces = tuple(pieces)

  def schedule(count):
    count = jnp.asarray(count, jnp.float32)
    lr = piece_value(pieces[0], count - pieces[0].start, jnp)
    for p in pieces[1:]:
      lr = jnp.where(count >= p.start, piece_value(p, count - p.start, jnp), lr)
    return lr

  return schedule


def _is_embedding_or_head(path) -> bool:
  s = path_string(path)
  return s.startswith("embed") or s.startswith("lm_head")


def _layer_ndim(path, x) -> int:
  """A parameter's rank per layer: a scanned stack's leaves ("stack/<j>/...", model.stack)
  have one more leading dim [R, ...] than the layer's own."""
  return x.ndim - (stacked_position(path_string(path)) is not None)


def decay_mask(params):
  """Weight decay on matrices (ndim >= 2 per layer) only; never on norms, gains, vectors."""
  return jax.tree_util.tree_map_with_path(lambda p, x: _layer_ndim(p, x) >= 2, params)


def _muon_dims(params):
  """Muon on hidden matrices: 2-D [in, out] and stacked experts [E, in, out] (and either
  stacked [R, ...] by a scanned layer stack: the leading dims are batch dims).

  Embedding, LM head and non-matrix parameters fall back to AdamW (None).
  """
  def spec(path, x):
    if _is_embedding_or_head(path) or _layer_ndim(path, x) < 2:
      return None
    return MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)

  return jax.tree_util.tree_map_with_path(spec, params)


def make_optimizer(t: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  """clip_by_global_norm(t.clip) -> AdamW or Muon at the learning rate `schedule`."""
  if t.optimizer == "adamw":
    opt = optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=1e-8, weight_decay=t.weight_decay,
                      mask=decay_mask)
  else:
    opt = muon(schedule, _muon_dims, decay_mask, b1=t.b1, b2=t.b2,
               weight_decay=t.weight_decay)
  if t.clip > 0:
    return optax.chain(optax.clip_by_global_norm(t.clip), opt)
  return opt


def learning_rate(schedule: optax.Schedule, applied_updates: jax.Array) -> jax.Array:
  """The learning rate of the next update, given how many updates were applied so far."""
  return jnp.asarray(schedule(applied_updates), jnp.float32)
