"""Small pieces for the train tests: a tiny real HybridLM config, the tiny run config, an
in-memory packed iterator and the train losses a run logged."""

from __future__ import annotations

import json
import os

import numpy as np

from hybridmoe_jax.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig
from hybridmoe_jax.config.run import default_config


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


# A 2-layer HybridLM (dense FFN, then MoE; d_model 16, 4 experts top-1). MLA mixers only:
# a KDA layer would add ~10 s to every compile (KDA runs in the tiny-config tests).
TINY_MODEL = dict(d_model=16, num_layers=2, layer_kinds=("mla", "mla"))
TINY_KDA = dict(num_heads=1, num_v_heads=1, head_dim=8, v_head_dim=8)
TINY_MLA = dict(num_heads=1, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8)
TINY_MOE = dict(num_experts=4, experts_per_token=1, expert_intermediate=16,
                shared_intermediate=16, dense_intermediate=32, qb_num_bins=64)


def tiny_model_config(vocab_size: int = 64, **moe) -> ModelConfig:
  """The tiny model as a ModelConfig; `moe` overrides MoEConfig fields."""
  return ModelConfig(vocab_size=vocab_size, **TINY_MODEL, kda=KDAConfig(**TINY_KDA),
                     mla=MLAConfig(**TINY_MLA), moe=MoEConfig(**{**TINY_MOE, **moe}))


def set_tiny_model(config) -> None:
  """Write the tiny model into a root ConfigDict's `model` section (for the loop tests);
  the vocabulary stays the caller's."""
  m = config.model
  m.update(TINY_MODEL)
  m.kda.update(TINY_KDA)
  m.mla.update(TINY_MLA)
  m.moe.update(TINY_MOE)
  config.compute.kda_chunk_size = 16


def tiny_run_config(**train):
  """The default run config on the tiny model: 8 short steps that log, evaluate, checkpoint
  and export often; `train` overrides config.train fields."""
  config = default_config()
  set_tiny_model(config)
  config.model.vocab_size = 64
  config.train.update({**dict(steps=8, batch_size=4, seq_len=16, lr=3e-2, warmup=2,
                              log_every=1, eval_every=4, eval_batches=2, checkpoint_every=3,
                              keep_checkpoints=5, heatmap_every=4, maxvio_alert_steps=3,
                              maxvio_alert_threshold=0.0, async_checkpoints=True), **train})
  return config


def train_losses(workdir):
  """{step: train loss} from workdir/metrics.jsonl."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if r.get("split") == "train":
        out[r["step"]] = r["loss"]          # a re-done step overwrites: last record wins
  return out
