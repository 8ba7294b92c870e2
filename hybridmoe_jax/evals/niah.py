"""Passkey needle-in-a-haystack (Mohtashami & Jaggi 2023, arXiv:2305.16300), byte tokens.

A prompt of exactly `context_len` tokens: BOS, repeated filler sentences with the needle
"The pass key is 48213. Remember it." inserted at a sentence boundary nearest to
depth * haystack, then "What is the pass key? The pass key is". The filler and the question
hold no digits, so the key occurs exactly once. Scored by exact match of the greedy
continuation's first `num_digits` characters.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np

from hybridmoe_jax import plots
from hybridmoe_jax.data.tokenizer import BOS_ID, ByteTokenizer
from hybridmoe_jax.infer import Engine

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
QUESTION = "What is the pass key? The pass key is "


def min_length(num_digits: int) -> int:
  """Shortest prompt holding BOS, the needle and the question (no filler)."""
  return 1 + len(f"The pass key is {'0' * num_digits}. Remember it. ") + len(QUESTION)


@dataclasses.dataclass(frozen=True)
class NiahExample:
  prompt: np.ndarray    # int32 [context_len]
  answer: str           # the passkey digits
  needle_start: int     # token index where the needle sentence starts
  depth: float          # requested depth in [0, 1]


def make_example(rng: np.random.Generator, context_len: int, depth: float,
                 num_digits: int = 5) -> NiahExample:
  """One prompt of exactly `context_len` tokens with the needle at ~`depth`."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"needle depth must be in [0, 1], got {depth}")
  answer = "".join(str(d) for d in rng.integers(0, 10, num_digits))
  needle = f"The pass key is {answer}. Remember it. "
  budget = context_len - 1 - len(needle) - len(QUESTION)
  if budget < 0:
    raise ValueError(f"niah context length {context_len} is too short for the needle and "
                     f"question (needs >= {min_length(num_digits)})")
  hay = (FILLER * (budget // len(FILLER) + 1))[:budget]
  # Sentence boundaries ("... . |") in the haystack, plus both ends.
  cuts = np.array([0] + [i + 2 for i in range(len(hay) - 1) if hay[i:i + 2] == ". "] + [budget])
  cut = int(cuts[np.argmin(np.abs(cuts - depth * budget))])
  text = hay[:cut] + needle + hay[cut:] + QUESTION
  prompt = np.concatenate([[BOS_ID], ByteTokenizer().encode(text)]).astype(np.int32)
  assert len(prompt) == context_len
  return NiahExample(prompt, answer, 1 + cut, depth)


def exact_match(predictions: Sequence[str], answers: Sequence[str]) -> float:
  """Fraction of predictions whose first len(answer) characters equal the answer."""
  if not answers:
    return float("nan")
  return float(np.mean([p[:len(a)] == a for p, a in zip(predictions, answers)]))


def evaluate_niah(engine: Engine, lengths: Sequence[int], depths: Sequence[float], *,
                  samples: int = 4, num_digits: int = 5, seed: int = 0,
                  output_dir: str | None = None) -> dict:
  """Accuracy over the grid [depths, lengths]; with `output_dir`, also niah_heatmap.png
  (`plots.niah_figure`: labelled axes, the accuracy written in each cell)."""
  rng = np.random.default_rng(seed)
  tok = ByteTokenizer()
  acc = np.zeros((len(depths), len(lengths)))
  for j, n in enumerate(lengths):
    if n + num_digits > engine.max_len:
      raise ValueError(f"niah length {n} + {num_digits} answer tokens exceeds max_len="
                       f"{engine.max_len}")
    for i, d in enumerate(depths):
      exs = [make_example(rng, n, d, num_digits) for _ in range(samples)]
      out = engine.generate(np.stack([e.prompt for e in exs]), max_new_tokens=num_digits)
      preds = [tok.decode(row) for row in out.tokens]
      acc[i, j] = exact_match(preds, [e.answer for e in exs])
  result = {"lengths": list(lengths), "depths": list(depths), "samples": samples,
            "num_digits": num_digits, "chance": 10.0 ** -num_digits,
            "accuracy": acc.tolist(), "mean_accuracy": float(acc.mean())}
  if output_dir:
    result["heatmap"] = plots.save(plots.niah_figure(result),
                                   os.path.join(output_dir, "niah_heatmap.png"))
  return result
