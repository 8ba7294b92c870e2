"""Small stand-ins for the train tests: a routed toy LM and an in-memory packed iterator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.train.state import ModelFns


class FakeBias(nnx.Variable):
  """Routing bias stand-in: state, not a parameter."""


class FakeMoE(nnx.Module):
  """Sigmoid router with a bias, top-k experts (one matrix each), additive load stats."""

  def __init__(self, d: int, num_experts: int, k: int, *, rngs: nnx.Rngs):
    self.k = k
    self.router = nnx.Param(jax.random.normal(rngs.params(), (d, num_experts)) * 0.5)
    self.experts = nnx.Param(jax.random.normal(rngs.params(), (num_experts, d, d)) * 0.1)
    self.bias = FakeBias(jnp.zeros((num_experts,), jnp.float32))

  def __call__(self, x, valid):
    s = jax.nn.sigmoid(x @ self.router[...])                       # [B, T, E]
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(s) + self.bias[...], self.k)
    onehot = jax.nn.one_hot(idx, s.shape[-1]).sum(-2)               # [B, T, E]
    w = onehot * s
    y = jnp.einsum("bte,btd,edf->btf", w, x, self.experts[...])
    load = jnp.sum(onehot * valid[..., None], axis=(0, 1)).astype(jnp.int32)
    return x + y, {"load": load}


class FakeLM(nnx.Module):
  """Embedding -> one FakeMoE -> LM head; the HybridLM call signature."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat: str = "none"):
    d = cfg.d_model
    self.dtype = jnp.float32  # the compute dtype is ComputeConfig.dtype, not the model's
    self.embed = nnx.Embed(cfg.vocab_size, d, rngs=rngs)
    self.moe = FakeMoE(d, cfg.moe.num_experts, cfg.moe.experts_per_token, rngs=rngs)
    self.head = nnx.Linear(d, cfg.vocab_size, rngs=rngs)

  def __call__(self, tokens, *, segment_ids=None):
    if segment_ids is None:
      segment_ids = jnp.ones_like(tokens)
    x = self.embed(tokens).astype(self.dtype)
    x, stats = self.moe(x, segment_ids > 0)
    return self.head(x.astype(jnp.float32)), {"moe": {"layer_1": stats}}


def fake_update_biases(biases, moe_stats, cfg: ModelConfig):
  """Sign rule on the single layer; MaxVio from the load (balancing "none" keeps the bias)."""
  load = moe_stats["layer_1"]["load"].astype(jnp.float32)
  mean = jnp.maximum(jnp.mean(load), 1e-9)
  max_vio = jnp.max(load) / mean - 1.0

  def upd(b):
    if cfg.moe.balancing == "none":
      return b
    return b - 0.05 * jnp.sign(load - mean)

  new = jax.tree.map(upd, biases)
  b = jax.tree.leaves(new)[0]
  return new, {"layer_1": {"max_vio": max_vio, "bias_min": jnp.min(b), "bias_max": jnp.max(b)}}


def fake_fns() -> ModelFns:
  return ModelFns(lambda cfg, seed, remat: FakeLM(cfg, rngs=nnx.Rngs(seed), remat=remat),
                  fake_update_biases, FakeBias)


class FakeIterator:
  """Deterministic packed batches with get_state/set_state (a checkpointable iterator)."""

  def __init__(self, batch_size: int, seq_len: int, vocab: int = 64, seed: int = 0,
               length: int | None = None):
    self.batch_size, self.seq_len, self.vocab, self.seed = batch_size, seq_len, vocab, seed
    self.length = length
    self.index = 0

  def __iter__(self):
    return self

  def __next__(self):
    if self.length is not None and self.index >= self.length:
      raise StopIteration
    rng = np.random.default_rng([self.seed, self.index])
    b, t = self.batch_size, self.seq_len
    # A learnable stream: token t+1 = (token t * 3 + 1) mod vocab, random restarts.
    tokens = np.zeros((b, t), np.int32)
    tokens[:, 0] = rng.integers(0, self.vocab, b)
    for i in range(1, t):
      tokens[:, i] = (tokens[:, i - 1] * 3 + 1) % self.vocab
    seg = np.ones((b, t), np.int32)
    seg[:, t // 2:] = 2
    seg[:, t - 3:] = 0                      # padding at the end
    tokens[seg == 0] = 0
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    self.index += 1
    return {"tokens": tokens, "segment_ids": seg, "positions": positions}

  def get_state(self):
    return {"index": self.index}

  def set_state(self, state):
    self.index = int(state["index"])


def fake_model_config(**moe) -> ModelConfig:
  from hybridmoe_jax.config import MoEConfig  # pylint: disable=g-import-not-at-top
  return ModelConfig(vocab_size=64, d_model=16, num_layers=2,
                     moe=MoEConfig(num_experts=4, experts_per_token=1, **moe))
