"""Learning-rate schedules and the optimizer (global-norm clipping, then AdamW or Muon)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from optax.contrib import MuonDimensionNumbers, muon


def make_schedule(t: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup to `t.lr`, then cosine / warmup-stable-decay (WSD) / constant.

  cosine: lr * (min + (1 - min) * (1 + cos(pi * s)) / 2), s = progress after warmup.
  wsd:    lr held until the last `decay_fraction` of the steps, then linear to min * lr.
  """
  peak, end = t.lr, t.lr * t.min_lr_ratio
  warmup_steps = min(t.warmup, t.steps)
  warmup = optax.linear_schedule(0.0, peak, warmup_steps) if warmup_steps else None
  rest = t.steps - warmup_steps
  if t.schedule == "cosine":
    main = optax.cosine_decay_schedule(peak, max(rest, 1), alpha=t.min_lr_ratio)
  elif t.schedule == "wsd":
    decay = min(int(round(t.steps * t.decay_fraction)), rest)
    main = optax.join_schedules(
        [optax.constant_schedule(peak), optax.linear_schedule(peak, end, max(decay, 1))],
        [rest - decay])
  else:
    main = optax.constant_schedule(peak)
  if warmup is None:
    return main
  return optax.join_schedules([warmup, main], [warmup_steps])


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                  for k in path)


def _is_embedding_or_head(path) -> bool:
  s = _path_str(path)
  return s.startswith("embed") or s.startswith("lm_head")


def decay_mask(params):
  """Weight decay on matrices (ndim >= 2) only; never on norms, gains, vectors."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


def _muon_dims(params):
  """Muon on hidden matrices: 2-D [in, out] and stacked experts [E, in, out].

  Embedding, LM head and non-matrix parameters fall back to AdamW (None).
  """
  def spec(path, x):
    if _is_embedding_or_head(path) or x.ndim < 2:
      return None
    return MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)

  return jax.tree_util.tree_map_with_path(spec, params)


def make_optimizer(t: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """clip_by_global_norm(t.clip) -> AdamW or Muon with `make_schedule(t)`."""
  schedule = make_schedule(t)
  if t.optimizer == "adamw":
    opt = optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=1e-8, weight_decay=t.weight_decay,
                      mask=decay_mask)
  else:
    opt = muon(schedule, weight_decay=t.weight_decay, weight_decay_mask=decay_mask,
               adam_b1=t.b1, adam_b2=t.b2, adam_weight_decay=t.weight_decay,
               muon_weight_dimension_numbers=_muon_dims, consistent_rms=0.2)
  if t.clip > 0:
    return optax.chain(optax.clip_by_global_norm(t.clip), opt)
  return opt


def learning_rate(t: ml_collections.ConfigDict, applied_updates: jax.Array) -> jax.Array:
  """The learning rate of the next update, given how many updates were applied so far."""
  return jnp.asarray(make_schedule(t)(applied_updates), jnp.float32)
