"""lm-evaluation-harness adapter: our models as an `lm_eval` LM named "hybridmoe_jax".

    python -m hybridmoe_jax.serve.lm_eval_adapter --model hybridmoe_jax \\
        --model_args workdir=runs/default,max_len=2048 --tasks lambada_openai

is the `lm_eval` command line with this model registered (lm_eval 0.4 finds models only in
its own registry: it has no plugin entry point, so importing this module is what registers
the class). In Python: `import hybridmoe_jax.serve.lm_eval_adapter` then
`lm_eval.simple_evaluate(model="hybridmoe_jax", model_args="workdir=...", tasks=[...])`.
Needs the optional extra `lm-eval` (lm_eval pulls torch: `pip install torch==2.13.0` first
for the CPU wheel).

model_args: workdir (anything `hybridmoe_jax.load` reads: a run, a params export, a
converted HF dir), max_len (cache capacity N = the longest scored sequence, default 2048),
prefill_chunk, dtype, batch_size (rows per engine call, default 8), max_gen_toks (default
256).

The three request kinds, on `LoadedModel` (the same numbers as `LoadedModel.score`):
  loglikelihood(context, continuation): BOS + context and continuation encoded apart (so
    the continuation's tokens are exactly its own), scored teacher-forced in one sequence;
    -> (sum of the continuation's log-probs, whether each of its tokens is the argmax). A
    context too long for N keeps its last tokens (lm_eval's convention); a continuation
    that cannot fit is an error.
  loglikelihood_rolling(text): the log-prob of every token of the text after BOS; a text
    longer than N is scored in lm_eval's rolling windows (each token predicted once, with
    as much context as fits). Equals -LoadedModel.score(text).nll when it fits.
  generate_until(context, {until, max_gen_toks, temperature, do_sample}): LoadedModel.generate
    (greedy unless do_sample), cut at the first `until` string; a context too long for N
    keeps its last tokens.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from hybridmoe_jax.api import load

NAME = "hybridmoe_jax"


def _int(value, name: str, lo: int) -> int:
  try:
    out = int(value)
  except (TypeError, ValueError):
    out = None
  if out is None or out < lo or str(value).strip() != str(out):
    raise ValueError(f"model_args {name}={value!r} is invalid: allowed an integer >= {lo}")
  return out


@register_model(NAME)
class HybridMoELM(LM):
  """An lm_eval LM over `hybridmoe_jax.load(workdir)` (see the module docstring)."""

  def __init__(self, workdir: str | None = None, max_len: int | str = 2048,
               prefill_chunk: int | str = 256, dtype: str | None = None,
               batch_size: int | str = 8, max_gen_toks: int | str = 256, **unused: Any):
    super().__init__()
    if not workdir:
      raise ValueError("model_args workdir= is required: a training workdir, params export "
                       "or converted Hugging Face dir")
    # lm_eval passes its own batch_size / device; "auto" batch sizes are not supported.
    unused.pop("device", None)
    if unused:
      raise ValueError(f"model_args {sorted(unused)} are unknown: allowed workdir, max_len, "
                       "prefill_chunk, dtype, batch_size, max_gen_toks")
    self.batch_size = _int(batch_size, "batch_size", 1)
    self.max_gen_toks = _int(max_gen_toks, "max_gen_toks", 1)
    self.model = load(workdir, dtype=dtype, max_len=_int(max_len, "max_len", 2),
                      prefill_chunk=_int(prefill_chunk, "prefill_chunk", 1))
    self.tokenizer = self.model.tokenizer
    self.max_len = self.model.max_len

  # ---- helpers -------------------------------------------------------------------------------
  def _encode(self, text: str, *, bos: bool) -> list[int]:
    return [int(i) for i in self.tokenizer.encode(text, bos=bos)] if (text or bos) else []

  def _score_rows(self, rows: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token rows -> per row (log-probs [T-1] of tokens[1:], argmax predictions [T-1]),
    batch_size rows (ragged: right-padded, with their lengths) per engine call."""
    out = []
    for s in range(0, len(rows), self.batch_size):
      tokens, lengths = self.model.pad_rows(rows[s:s + self.batch_size])
      nll, pred = self.model.engine.score(tokens, lengths)
      out += [(-nll[j, :n - 1].astype(np.float64), pred[j, :n - 1])
              for j, n in enumerate(lengths)]
    return out

  # ---- the three request kinds ---------------------------------------------------------------
  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    rows, spans = [], []
    for k, req in enumerate(requests):
      context, continuation = req.args
      ctx, cont = self._encode(context, bos=True), self._encode(continuation, bos=False)
      if not cont:
        raise ValueError(f"request {k}: the continuation {continuation!r} encodes to no "
                         "tokens: nothing to score")
      if len(cont) + 1 > self.max_len:
        raise ValueError(f"request {k}: a continuation of {len(cont)} tokens does not fit "
                         f"max_len={self.max_len} with one token of context (raise max_len)")
      row = (ctx + cont)[-self.max_len:]
      rows.append(row)
      spans.append(len(cont))
    out = []
    for req, row, (logp, pred), n in zip(requests, rows, self._score_rows(rows), spans):
      result = (float(logp[-n:].sum()), bool(np.array_equal(pred[-n:], row[-n:])))
      self.cache_hook.add_partial("loglikelihood", req.args, result)
      out.append(result)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    out = []
    for req in requests:
      (text,) = req.args
      ids = self._encode(text, bos=False)
      windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
          ids, prefix_token=int(self.tokenizer.bos_id), max_seq_len=self.max_len - 1,
          context_len=1)]
      rows = [list(ctx) + list(pred) for ctx, pred in windows]
      scored = self._score_rows(rows) if rows else []
      total = sum(float(logp[-len(pred):].sum())
                  for (logp, _), (_, pred) in zip(scored, windows))
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
      out.append(total)
    return out

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    out = []
    for req in requests:
      context, kwargs = req.args
      kwargs = dict(kwargs or {})
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_new = _int(kwargs.pop("max_gen_toks", self.max_gen_toks), "max_gen_toks", 1)
      max_new = min(max_new, self.max_len - 1)
      do_sample = bool(kwargs.pop("do_sample", False))
      temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
      ids = self._encode(context, bos=True)
      room = self.max_len - max_new
      if len(ids) > room:
        ids = [int(self.tokenizer.bos_id)] + ids[len(ids) - room + 1:]
      text = self.model.generate(ids, max_new_tokens=max_new, temperature=temperature,
                                 top_p=float(kwargs.pop("top_p", 1.0)), stop=until)
      self.cache_hook.add_partial("generate_until", req.args, text)
      out.append(text)
    return out

  @property
  def tokenizer_name(self) -> str:
    return getattr(self.tokenizer, "name", type(self.tokenizer).__name__)


def main(argv: list[str] | None = None) -> None:
  """The lm_eval command line with the "hybridmoe_jax" model registered."""
  from lm_eval.__main__ import cli_evaluate
  if argv is not None:
    sys.argv = [sys.argv[0], *argv]
  cli_evaluate()


if __name__ == "__main__":
  main()
