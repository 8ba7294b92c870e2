"""Shared pieces of the inference tests: the reference forward, random tokens (the tiny
models are tests/_support.py's `tiny_model`)."""

import jax
from flax import nnx


def full_logits(model, tokens):
  """Reference: the training forward over the whole sequence, jitted."""
  return nnx.jit(lambda m, t: m(t)[0])(model, tokens)


def random_tokens(seed, b, t, vocab=256):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, vocab)
