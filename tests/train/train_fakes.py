"""Small pieces for the train tests: the tiny run config (on tests/_support.py's mini model),
an in-memory packed iterator and the train losses a run logged."""

from __future__ import annotations

import json
import os

import numpy as np

from hybridmoe_jax.config.run import default_config
from tests._support import MINI_KDA, MINI_MLA, MINI_MODEL, MINI_MOE


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


def set_tiny_model(config) -> None:
  """Write the 2-layer MLA-only model (tests/_support.py's MINI_*) into a root ConfigDict's
  `model` section (for the loop tests); the vocabulary stays the caller's."""
  m = config.model
  m.update(MINI_MODEL)
  m.kda.update(MINI_KDA)
  m.mla.update(MINI_MLA)
  m.moe.update(MINI_MOE)
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
