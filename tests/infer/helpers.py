"""Shared tiny models for the inference tests."""

import functools

import jax
from flax import nnx

from hybridmoe_jax.model import HybridLM
from tests._support import tiny_model_config


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0) -> HybridLM:
  """The tiny hybrid (3 KDA + 1 MLA, AttnRes, MoE), fp32."""
  return HybridLM(tiny_model_config(), rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=None)
def two_layer_model(seed: int = 0) -> HybridLM:
  """The tiny hybrid cut to one KDA layer (dense FFN) and one MLA layer (MoE), AttnRes on:
  every kind of layer at half the compile and init time, for tests whose claim does not
  depend on the depth."""
  return HybridLM(tiny_model_config(num_layers=2, layer_kinds=("kda", "mla")), rngs=nnx.Rngs(seed))


def full_logits(model, tokens):
  """Reference: the training forward over the whole sequence, jitted."""
  return nnx.jit(lambda m, t: m(t)[0])(model, tokens)


def random_tokens(seed, b, t, vocab=256):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, vocab)
