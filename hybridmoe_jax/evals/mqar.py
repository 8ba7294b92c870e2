"""Multi-query associative recall (Zoology, Arora et al. 2023, arXiv:2312.04927).

A sequence of `seq_len` tokens: `pairs` key-value pairs (k_1 v_1 ... k_n v_n, distinct keys,
distinct values), then a query region where each key appears once more at position
2 * (pairs + gap) with gaps drawn without replacement from a power law p(gap) ~ gap^(a-1)
(a = 0.01: most queries come soon after the pairs, a long tail far away). The model must
predict the key's value as the NEXT token after the query (teacher-forced, one scored token
per query). Other positions hold noise. The token ranges are disjoint thirds of `vocab`
(keys | values | noise), unlike Zoology's random noise over the whole vocabulary, so every
key and value occurs exactly once in the context and a query is never ambiguous.
Accuracy = mean over queries of argmax == value; a constant guess scores 1 / num_values.
The same task in the text format a language model is trained on is the key-value recall of
`benchmarks/long_context_retrieval.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from hybridmoe_jax.infer import Engine


@dataclasses.dataclass(frozen=True)
class MQARBatch:
  inputs: np.ndarray       # int32 [N, seq_len]
  targets: np.ndarray      # int32 [N, seq_len]: the value to predict at a query, else -1
  query_pos: np.ndarray    # int32 [N, pairs]: positions of the queried keys
  keys: np.ndarray         # int32 [N, pairs] in context order
  values: np.ndarray       # int32 [N, pairs]


def token_ranges(vocab: int) -> tuple[range, range, range]:
  third = vocab // 3
  return range(0, third), range(third, 2 * third), range(2 * third, vocab)


def make_mqar(rng: np.random.Generator, n: int, seq_len: int, pairs: int, *,
              vocab: int = 256, power_a: float = 0.01) -> MQARBatch:
  """n MQAR sequences; raises ValueError if the pairs and queries do not fit."""
  keys_r, vals_r, noise_r = token_ranges(vocab)
  context = 2 * pairs
  space = (seq_len - context) // 2          # query slots: even offsets after the context
  if pairs < 1 or space < pairs or pairs > len(keys_r):
    raise ValueError(f"mqar: {pairs} pairs do not fit in {seq_len} tokens (need "
                     f"seq_len >= {4 * pairs}) or exceed the {len(keys_r)} key tokens")
  p = power_a * np.arange(1, space + 1) ** (power_a - 1)
  p /= p.sum()
  inputs = rng.integers(noise_r.start, noise_r.stop, (n, seq_len)).astype(np.int32)
  targets = np.full((n, seq_len), -1, np.int32)
  keys = np.stack([rng.choice(keys_r, pairs, replace=False) for _ in range(n)]).astype(np.int32)
  values = np.stack([rng.choice(vals_r, pairs, replace=False) for _ in range(n)]).astype(
      np.int32)
  inputs[:, 0:context:2], inputs[:, 1:context:2] = keys, values
  gaps = np.stack([rng.choice(space, pairs, replace=False, p=p) for _ in range(n)])
  query_pos = (context + 2 * gaps).astype(np.int32)
  order = np.stack([rng.permutation(pairs) for _ in range(n)])   # which key each query asks
  rows = np.arange(n)[:, None]
  inputs[rows, query_pos] = keys[rows, order]
  targets[rows, query_pos] = values[rows, order]
  return MQARBatch(inputs, targets, query_pos, keys, values)


def accuracy(predictions: np.ndarray, targets: np.ndarray) -> float:
  """predictions [N, T] of the next token at each position; targets -1 where unscored."""
  mask = targets >= 0
  return float(np.mean(predictions[mask] == targets[mask])) if mask.any() else float("nan")


def evaluate_mqar(engine: Engine, lengths: Sequence[int], pairs: Sequence[int], *,
                  samples: int = 16, seed: int = 0, vocab: int = 256) -> dict:
  """Accuracy per (length, pairs) cell; cells whose pairs do not fit are skipped."""
  rng = np.random.default_rng(seed)
  cells = []
  for t in lengths:
    if t > engine.max_len:
      raise ValueError(f"mqar length {t} exceeds max_len={engine.max_len}")
    for n_pairs in pairs:
      if 4 * n_pairs > t:
        continue
      batch = make_mqar(rng, samples, t, n_pairs, vocab=vocab)
      _, pred = engine.score(batch.inputs)             # pred[:, i] predicts token i + 1
      acc = accuracy(pred, batch.targets[:, :-1])
      cells.append({"length": t, "pairs": n_pairs, "accuracy": acc,
                    "queries": int(samples * n_pairs)})
  if not cells:
    raise ValueError(f"mqar: no (length, pairs) cell fits: lengths {list(lengths)}, pairs "
                     f"{list(pairs)} (need length >= 4 * pairs)")
  chance = 1.0 / len(token_ranges(vocab)[1])
  return {"cells": cells, "chance": chance, "samples": samples,
          "mean_accuracy": float(np.mean([c["accuracy"] for c in cells]))}

