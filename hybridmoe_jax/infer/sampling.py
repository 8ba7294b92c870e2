"""Next-token sampling: greedy, temperature, top-k and top-p, all traced (no recompiles).

logits [B, V] float32 -> tokens [B] int32. temperature <= 0 means greedy (argmax).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hybridmoe_jax.config import Checked, ranged

_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class SamplingConfig(Checked):
  """vocab_limit n > 0: ids >= n are never drawn (a tokenizer with fewer ids than the model's
  embedding rows, e.g. an embedding padded to a multiple of 128). Checked when built."""

  PATH = "sampling"
  temperature: float = ranged(0.0, ">= 0", "0: greedy")
  top_k: int = ranged(0, ">= 0", "0: off")
  top_p: float = ranged(1.0, "(0, 1]", "1: off")
  vocab_limit: int = ranged(0, ">= 0", "0: every id")

  def as_arrays(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    return (jnp.float32(self.temperature), jnp.int32(self.top_k), jnp.float32(self.top_p),
            jnp.int32(self.vocab_limit))


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Set logits outside the top-k / nucleus (top-p) set to -1e30.

  Ties at the cut-off value are kept (the set may exceed k by the number of ties).
  The nucleus is the smallest non-empty prefix of the sorted distribution whose mass reaches
  top_p.
  """
  v = logits.shape[-1]
  desc = -jnp.sort(-logits, axis=-1)                                       # [B, V]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1])[..., None], -1)
  desc = jnp.where(desc >= kth, desc, _NEG)
  probs = jax.nn.softmax(desc, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs        # mass strictly above each entry
  keep = (before < top_p) | (top_p >= 1.0)    # top_p 1 is off exactly (cumsum rounding)
  keep |= jnp.arange(v) == 0    # the top id: a top_p under float32's range (1e-50) is 0
  cut = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where((logits >= cut) & (logits >= kth), logits, _NEG)


def sampling_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array, vocab_limit: jax.Array | int = 0) -> jax.Array:
  """logits [..., V] -> the logits of the distribution `sample` draws from, [..., V] fp32.

  ids >= vocab_limit (if > 0) removed, divided by the temperature, then top-k / top-p
  (filter_logits, on the tempered distribution); removed ids get -1e30, so
  log_softmax(sampling_logits(...)) is the log-prob of the renormalised truncated
  distribution. Greedy (temperature <= 0) is the point mass on the argmax: 0 there, -1e30
  elsewhere. The rollouts record behaviour log-probs and the RL learner computes policy
  log-probs with this one function.
  """
  logits = logits.astype(jnp.float32)
  ids = jnp.arange(logits.shape[-1])
  logits = jnp.where((vocab_limit <= 0) | (ids < vocab_limit), logits, _NEG)
  scaled = filter_logits(logits / jnp.maximum(temperature, 1e-6), top_k, top_p)
  greedy = jnp.where(ids == jnp.argmax(logits, axis=-1, keepdims=True), 0.0, _NEG)
  return jnp.where(temperature > 0, scaled, greedy)


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, vocab_limit: jax.Array | int = 0) -> jax.Array:
  """logits [B, V] -> [B] int32; temperature/top_k/top_p/vocab_limit are traced scalars."""
  return draw_from(sampling_logits(logits, temperature, top_k, top_p, vocab_limit), key,
                   temperature)


def draw_from(dist: jax.Array, key: jax.Array, temperature: jax.Array) -> jax.Array:
  """dist [B, V] (sampling_logits) -> [B] int32: a categorical draw, the argmax if greedy."""
  drawn = jax.random.categorical(key, dist, axis=-1).astype(jnp.int32)
  greedy = jnp.argmax(dist, axis=-1).astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)
