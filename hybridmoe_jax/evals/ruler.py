"""The RULER-style long-context suite (`run_eval.py --task=ruler`): tasks x lengths, scored.

Prompts come from `ruler_tasks` (exact token lengths for the model's tokenizer, held-out-by-
source haystacks from `ruler_text`); the model answers greedily (`Engine.generate`, stopping
at EOS) for a task-sized number of new tokens; each prompt is scored by RULER's recall
(`string_match_all`). Per cell: the mean recall ("score", RULER's figure), the fraction of
prompts with every reference found ("all_correct") and its 95% Wilson interval.

Seeds: fresh per call (drawn from the OS and recorded in the result) unless `seed` is given;
a cell's prompts depend only on (seed, split, task, length), so a recorded seed reproduces
the run. `split="validation"` draws from the validation files (choose recipes there),
"test" from the test files (report them).
"""

from __future__ import annotations

import math
import os
import zlib
from typing import Sequence

import numpy as np

from hybridmoe_jax import plots
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.evals import ruler_tasks, ruler_text
from hybridmoe_jax.infer import Engine, SamplingConfig

TASKS = tuple(ruler_tasks.TASKS)
EXPECTATION = ("the retrieval recipe configs/long_context_cpu.py (0.22M parameters, trained on "
               "other wording and other text) scores 0.00 on every RULER-wording task at its "
               "trained 8K (100 prompts: 95% interval [0, 0.04]) and 0.70 on the `passkey` "
               "diagnostic (its own wording on this held-out text); BENCHMARKS.md, "
               "'RULER-style suite'")
_GEN_ROUND = 16    # new-token counts rounded up to this: cells share compilations


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
  """The Wilson score interval of a binomial proportion (95% at z = 1.96); (0, 1) for n 0."""
  if n <= 0:
    return 0.0, 1.0
  p = successes / n
  denom = 1 + z * z / n
  center = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  # At p = 0 or 1 the bound is exactly 0 or 1 (rounding would leave 1e-16 off).
  return (0.0 if successes == 0 else max(0.0, center - half),
          1.0 if successes == n else min(1.0, center + half))


def fresh_seed() -> int:
  """A seed from the OS's entropy (63 bits), to be recorded with the result."""
  return int(np.random.SeedSequence().entropy % (1 << 63))


def cell_rng(seed: int, split: str, task: str, length: int) -> np.random.Generator:
  """The generator of one cell: a pure function of its coordinates (stable across runs)."""
  return np.random.default_rng([seed, ruler_text.SPLITS.index(split),
                                zlib.crc32(task.encode()), length])


def new_tokens(answers: Sequence[Sequence[str]], tok: Tokenizer) -> int:
  """Tokens to generate for a batch: 1.5x the longest joined answer + 8, rounded up."""
  longest = max(len(tok.encode(", ".join(a))) for a in answers)
  n = int(1.5 * longest) + 8
  return -(-n // _GEN_ROUND) * _GEN_ROUND


def check_options(tasks: Sequence[str], lengths: Sequence[int], samples: int, batch: int,
                  split: str) -> None:
  """ValueError (one line, the field and its allowed range) before any compute."""
  bad = [t for t in tasks if t not in ruler_tasks.TASKS]
  if bad or not tasks:
    raise ValueError(f"--ruler_tasks: {bad or 'empty'} not among {TASKS}")
  if not lengths or min(lengths) < 64:
    raise ValueError(f"--ruler_lengths must hold lengths >= 64, got {tuple(lengths)}")
  if samples < 1 or batch < 1:
    raise ValueError(f"--ruler_samples and --ruler_batch must be >= 1, got {samples}, {batch}")
  if split not in ruler_text.SPLITS:
    raise ValueError(f"--ruler_split must be one of {ruler_text.SPLITS}, got {split!r}")


def evaluate_ruler(engine: Engine, tasks: Sequence[str], lengths: Sequence[int], *,
                   samples: int = 8, seed: int | None = None, split: str = "test",
                   batch: int = 8, tokenizer: Tokenizer | None = None,
                   output_dir: str | None = None, keep_examples: int = 2) -> dict:
  """Score `engine` on every (task, length) cell with `samples` prompts each.

  Returns a dict: "tasks" [T], "lengths" [L], "score" / "all_correct" / "wilson_low" /
  "wilson_high" [T][L] floats in [0, 1], "cells" (one dict per cell with a few predictions),
  "seed" (the one used), "seed_fixed", "split", "corpus" (`ruler_text.corpus_info`). With
  `output_dir`, also ruler_heatmap.png (`plots.ruler_figure`).
  """
  check_options(tasks, lengths, samples, batch, split)
  tok = tokenizer or ByteTokenizer()
  seed_fixed = seed is not None
  seed = int(seed) if seed_fixed else fresh_seed()
  pieces = ruler_tasks.new_pieces(tok)
  sampling = SamplingConfig(0.0, vocab_limit=tok.vocab_size)
  shape = (len(tasks), len(lengths))
  score, strict, lo, hi = (np.zeros(shape) for _ in range(4))
  for task in tasks:   # a length too short for a task fails here, before any compute
    ruler_tasks.make_example(task, cell_rng(seed, split, task, 0), min(lengths), tok, split,
                             pieces)
  cells = []
  for i, task in enumerate(tasks):
    for j, n in enumerate(lengths):
      rng = cell_rng(seed, split, task, n)
      recalls, examples, max_new = [], [], 0
      for start in range(0, samples, batch):
        exs = [ruler_tasks.make_example(task, rng, n, tok, split, pieces)
               for _ in range(min(batch, samples - start))]
        k = new_tokens([e.answers for e in exs], tok)
        max_new = max(max_new, k)
        engine.check_fits(n, k, f"ruler {task} prompt")
        out = engine.generate(np.stack([e.prompt for e in exs]), max_new_tokens=k,
                              sampling=sampling, stop_tokens=[tok.eos_id], pad_id=tok.pad_id)
        for e, row, m in zip(exs, out.tokens, out.lengths):
          pred = tok.decode(row[:int(m)])
          recalls.append(ruler_tasks.string_match_all(pred, e.answers))
          if len(examples) < keep_examples:
            examples.append({"answers": list(e.answers), "prediction": pred[:200]})
      full = int(sum(r == 1.0 for r in recalls))
      score[i, j], strict[i, j] = float(np.mean(recalls)), full / samples
      lo[i, j], hi[i, j] = wilson(full, samples)
      cells.append({"task": task, "length": n, "samples": samples,
                    "score": float(score[i, j]), "all_correct": float(strict[i, j]),
                    "wilson_low": float(lo[i, j]), "wilson_high": float(hi[i, j]),
                    "max_new_tokens": max_new,
                    "examples": examples})
  result = {"tasks": list(tasks), "lengths": list(lengths), "samples": samples,
            "seed": seed, "seed_fixed": seed_fixed, "split": split,
            "corpus": ruler_text.corpus_info(split), "expectation": EXPECTATION,
            "score": score.tolist(), "all_correct": strict.tolist(),
            "wilson_low": lo.tolist(), "wilson_high": hi.tolist(),
            "mean_score": float(score.mean()), "cells": cells}
  if output_dir:
    result["heatmap"] = plots.save(plots.ruler_figure(result),
                                   os.path.join(output_dir, "ruler_heatmap.png"))
  return result


def format_table(r: dict) -> str:
  """Per task x length: score, and the all-correct rate with its 95% Wilson interval."""
  w = max(len(t) for t in r["tasks"]) + 1
  lines = [f"{'task':<{w}}" + "".join(f"{n:>21}" for n in r["lengths"])]
  for i, t in enumerate(r["tasks"]):
    lines.append(f"{t:<{w}}" + "".join(
        f"{r['score'][i][j]:>6.2f} ({r['wilson_low'][i][j]:.2f}-{r['wilson_high'][i][j]:.2f})"
        f"{'':>3}" for j in range(len(r["lengths"]))))
  lines.append(f"score = RULER recall (mean over {r['samples']} prompts per cell); in "
               f"brackets the 95% Wilson interval of the all-references-found rate; split "
               f"{r['split']}, seed {r['seed']}{' (fixed)' if r['seed_fixed'] else ' (fresh)'}")
  return "\n".join(lines)
