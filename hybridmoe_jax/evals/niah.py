"""Passkey needle-in-a-haystack (Mohtashami & Jaggi 2023, arXiv:2305.16300), any tokenizer.

A prompt of exactly `context_len` tokens in the format of the training documents
(`data.retrieval.passkey_document`): BOS, filler sentences with the needle
"The pass key is 48213. Remember it. " inserted at the sentence boundary nearest to
depth * haystack, then "What is the pass key? The pass key is ". Held out from training: the
key comes from the evaluation key space and the filler from the evaluation seed stream
(`retrieval.key_split`, `retrieval.rng_for`). The filler and the question hold no digits, so
the key occurs exactly once. Scored by exact match of the greedy continuation's first
`num_digits` characters (chance 10^-num_digits). Each filler sentence, the needle and the
question are tokenized alone and joined, so the haystack is counted (and cut) in tokens; with
the byte tokenizer a token is a character.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe_jax import plots
from hybridmoe_jax.data import retrieval
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.evals import ruler_tasks
from hybridmoe_jax.infer import Engine

QUESTION = retrieval.QUESTION
# What to expect, printed with every NIAH result (`run_eval --task=niah`).
EXPECTATION = ("a tiny model after the default 300-step run scores at chance (10^-digits, "
               "greedy answers not even digits); the retrieval recipe `python run_train.py "
               "--config=configs/long_context_cpu.py` (~26 min on 2 CPU cores) retrieves "
               "held-out passkeys on 3 of 3 seeds: 1.00 at its trained 8K and at 32K "
               "(BENCHMARKS.md, 'Long-context retrieval')")


def min_length(num_digits: int, tokenizer: Tokenizer | None = None) -> int:
  """Shortest prompt holding BOS, the needle and the question (no filler); for a BPE the
  needle's length may differ by a token or so with the digits."""
  tok = tokenizer or ByteTokenizer()
  return 1 + len(tok.encode(retrieval.needle_text("0" * num_digits))) + len(tok.encode(QUESTION))


@dataclasses.dataclass(frozen=True)
class NiahExample:
  prompt: np.ndarray    # int32 [context_len]
  answer: str           # the passkey digits
  needle_start: int     # token index where the needle sentence starts
  depth: float          # requested depth in [0, 1]


def make_example(rng: np.random.Generator, context_len: int, depth: float,
                 num_digits: int = 5, tokenizer: Tokenizer | None = None,
                 split: str = "eval") -> NiahExample:
  """One prompt of exactly `context_len` tokens with the needle at ~`depth` (default
  tokenizer: bytes); the key is drawn from `split`'s key space (held out: "eval")."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"needle depth must be in [0, 1], got {depth}")
  tok = tokenizer or ByteTokenizer()
  answer = retrieval.draw_key(rng, split, num_digits)
  needle, question = tok.encode(retrieval.needle_text(answer)), tok.encode(QUESTION)
  budget = context_len - 1 - len(needle) - len(question)
  if budget < 0:
    raise ValueError(f"niah context length {context_len} is too short for the needle and "
                     f"question (needs >= {min_length(num_digits, tok)})")
  hay, cuts, _ = ruler_tasks.fill_haystack(retrieval.hay_sentences(rng),
                                           ruler_tasks.new_pieces(tok), budget)
  cut = ruler_tasks.nearest_cut(cuts, depth, budget)
  prompt = np.concatenate([[tok.bos_id], hay[:cut], needle, hay[cut:], question]
                          ).astype(np.int32)
  assert len(prompt) == context_len
  return NiahExample(prompt, answer, 1 + cut, depth)


def exact_match(predictions: Sequence[str], answers: Sequence[str]) -> float:
  """Fraction of predictions whose first len(answer) characters equal the answer."""
  if not answers:
    return float("nan")
  return float(np.mean([p[:len(a)] == a for p, a in zip(predictions, answers)]))


def digit_accuracy(predictions: Sequence[str], answers: Sequence[str]) -> float:
  """Fraction of the answers' digits predicted at their place (chance 0.1): a graded signal
  where whole keys are rarely right."""
  if not answers:
    return float("nan")
  return float(np.mean([np.mean([i < len(p) and p[i] == ch for i, ch in enumerate(a)])
                        for p, a in zip(predictions, answers)]))


def _continue(engine: Engine, logits, cache, feed: np.ndarray | None, steps: int):
  """From the prompt's last logits [B, V] and its cache: feed `feed` [B, steps - 1] (None:
  the greedy choice) one token at a time -> (tokens [B, steps] the greedy choices, log-probs
  [B, steps, V] before each fed token). Works on a copy of the cache (decode donates it)."""
  cache = jax.tree.map(jnp.copy, cache)
  toks, logps = [], []
  for i in range(steps):
    logps.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)))
    toks.append(np.asarray(jnp.argmax(logits, -1)))
    if i + 1 < steps:
      nxt = toks[-1] if feed is None else feed[:, i]
      logits, cache = engine.decode_step(np.asarray(nxt, np.int32), cache)
  return np.stack(toks, 1), np.stack(logps, 1)


def _key_nll(engine: Engine, logits, cache, keys: np.ndarray) -> np.ndarray:
  """[B] summed NLL (nats) of the key tokens [B, n] teacher-forced after the prompt."""
  _, logp = _continue(engine, logits, cache, keys, keys.shape[1])
  return -np.take_along_axis(logp, keys[..., None], axis=-1)[..., 0].sum(1)


def evaluate_niah(engine: Engine, lengths: Sequence[int], depths: Sequence[float], *,
                  samples: int = 4, num_digits: int = 5, seed: int = 0,
                  output_dir: str | None = None, tokenizer: Tokenizer | None = None) -> dict:
  """Exact-match and digit accuracy over the grid [depths, lengths] of the greedy answer,
  and a graded retrieval signal that does not need a right answer: the key's NLL per digit
  teacher-forced after the prompt ("key_nll"), against a random other key of the same length
  after the same prompt ("key_nll_gain" = NLL(other) - NLL(key), nats per digit: > 0 when the
  model reads the needle, ~0 when it ignores it). With `output_dir`, also niah_heatmap.png
  (`plots.niah_figure`: labelled axes, the accuracy written in each cell). tokenizer: the
  model's (default bytes)."""
  rng = retrieval.rng_for("eval", seed, 0)
  tok = tokenizer or ByteTokenizer()
  acc = np.zeros((len(depths), len(lengths)))
  digits, key_nll, gain = np.zeros_like(acc), np.zeros_like(acc), np.zeros_like(acc)
  for j, n in enumerate(lengths):
    if n + num_digits > engine.max_len:
      raise ValueError(f"niah length {n} + {num_digits} answer tokens exceeds max_len="
                       f"{engine.max_len}")
    for i, d in enumerate(depths):
      exs = [make_example(rng, n, d, num_digits, tok) for _ in range(samples)]
      others = [retrieval.draw_key(rng, "eval", num_digits) for _ in exs]
      logits, cache = engine.prefill(np.stack([e.prompt for e in exs]))
      out, _ = _continue(engine, logits, cache, None, num_digits)
      preds = [tok.decode(row) for row in out]
      acc[i, j] = exact_match(preds, [e.answer for e in exs])
      digits[i, j] = digit_accuracy(preds, [e.answer for e in exs])
      nll = {}
      for name, keys in (("key", [e.answer for e in exs]), ("other", others)):
        ids = [tok.encode(k) for k in keys]
        if len({len(x) for x in ids}) == 1:   # one length: scored as one batch
          nll[name] = _key_nll(engine, logits, cache, np.stack(ids)) / num_digits
        else:                                 # a BPE may split keys unevenly: row by row
          nll[name] = np.array([_key_nll(engine, logits[r:r + 1],
                                         jax.tree.map(lambda a, r=r: a[r:r + 1], cache),
                                         np.asarray([x]))[0] for r, x in enumerate(ids)]
                               ) / num_digits
      key_nll[i, j] = float(nll["key"].mean())
      gain[i, j] = float((nll["other"] - nll["key"]).mean())
  result = {"lengths": list(lengths), "depths": list(depths), "samples": samples,
            "num_digits": num_digits, "chance": 10.0 ** -num_digits,
            "expectation": EXPECTATION,
            "accuracy": acc.tolist(), "mean_accuracy": float(acc.mean()),
            "digit_accuracy": digits.tolist(), "mean_digit_accuracy": float(digits.mean()),
            "key_nll": key_nll.tolist(), "key_nll_gain": gain.tolist(),
            "mean_key_nll_gain": float(gain.mean())}
  if output_dir:
    result["heatmap"] = plots.save(plots.niah_figure(result),
                                   os.path.join(output_dir, "niah_heatmap.png"))
  return result
