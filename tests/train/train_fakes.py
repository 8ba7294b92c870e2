"""Small pieces for the train tests: an in-memory packed iterator and the train losses a run
logged (the tiny run config is tests/_support.py's `tiny_run_config`)."""

from __future__ import annotations

import json
import os

import numpy as np


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


def train_losses(workdir):
  """{step: train loss} from workdir/metrics.jsonl."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if r.get("split") == "train":
        out[r["step"]] = r["loss"]          # a re-done step overwrites: last record wins
  return out
