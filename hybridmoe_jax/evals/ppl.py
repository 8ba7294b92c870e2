"""Perplexity and bits per byte on held-out text, per context-length bucket.

Each document is tokenized as in training (BOS + text tokens + EOS), truncated to `max_len`
tokens and scored teacher-forced with chunked prefill (`Engine.score`), so long documents
run in bounded memory. The NLL of the token at position t (predicted from t tokens of
context) is charged to the bucket holding t: buckets [0, e_1), [e_1, e_2), ... from `edges`.
bits/byte = sum NLL / ln 2 / UTF-8 bytes of the targets (`Tokenizer.token_bytes`; the EOS
NLL is charged to the text, as in training).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.config.run import DataConfig
from hybridmoe_jax.infer import Engine


def heldout_documents(data_cfg=None, text_files: Sequence[str] = ()) -> list[str]:
  """Documents from `text_files`, else the held-out split of a data config (default: bundled)."""
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.data import source_from_config, split_source
  from hybridmoe_jax.data.sources import TextFileSource
  if text_files:
    source = TextFileSource(list(text_files))
    return [source[i] for i in range(len(source))]
  data_cfg = data_cfg or DataConfig()
  _, heldout = split_source(source_from_config(data_cfg), data_cfg.heldout_fraction,
                            data_cfg.heldout_seed)
  return [heldout[i] for i in range(len(heldout))]


def bucket_edges(max_len: int, edges: Sequence[int] = (64, 256, 1024, 4096, 16384, 65536)
                 ) -> list[int]:
  """Sorted bucket starts below max_len, beginning with 0."""
  return [0] + sorted(e for e in set(edges) if 0 < e < max_len)


def bucket_stats(nll: np.ndarray, targets: np.ndarray, edges: Sequence[int],
                 token_bytes: np.ndarray | None = None) -> list[dict[str, float]]:
  """Per bucket: tokens, mean nll, ppl, bits/byte. nll/targets [n] for context 1..n;
  token_bytes int32 [vocab]: UTF-8 bytes per id (default: the byte tokenizer's)."""
  if token_bytes is None:
    token_bytes = ByteTokenizer(vision=True).token_bytes()
  nb = np.asarray(token_bytes)[np.asarray(targets)]
  ctx = np.arange(1, len(nll) + 1)
  out = []
  bounds = list(edges) + [np.inf]
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    sel = (ctx >= lo) & (ctx < hi)
    n, nbytes = int(sel.sum()), int(nb[sel].sum())
    total = float(nll[sel].sum())
    out.append({"context_from": int(lo), "context_to": None if hi == np.inf else int(hi),
                "tokens": n, "nll_sum": total, "bytes": nbytes})
  return out


def _finish(row: dict) -> dict:
  n, b = row["tokens"], row["bytes"]
  row["nll"] = row["nll_sum"] / n if n else float("nan")
  row["ppl"] = math.exp(row["nll"]) if n else float("nan")
  row["bits_per_byte"] = row["nll_sum"] / max(b, 1) / math.log(2) if n else float("nan")
  return row


def evaluate_ppl(engine: Engine, documents: Sequence[str], *, max_docs: int = 16,
                 max_tokens: int | None = None,
                 edges: Sequence[int] = (64, 256, 1024, 4096, 16384, 65536),
                 tokenizer: Tokenizer | None = None) -> dict:
  """-> {"buckets": [...], "overall": {...}, "documents": n} (see module docstring).

  Each document is truncated to max_tokens (<= engine.max_len; default engine.max_len).
  tokenizer: the model's (default bytes).
  """
  if not documents:
    raise ValueError("ppl: no held-out documents to evaluate")
  max_tokens = min(max_tokens or engine.max_len, engine.max_len)
  tok = tokenizer or ByteTokenizer()
  token_bytes = tok.token_bytes()
  edges = bucket_edges(max_tokens, edges)
  rows = None
  used = 0
  for doc in documents[:max_docs]:
    ids = tok.encode(doc, bos=True, eos=True)[:max_tokens]
    if len(ids) < 2:
      continue
    nll, _ = engine.score(ids[None])
    stats = bucket_stats(nll[0], ids[1:], edges, token_bytes)
    rows = stats if rows is None else [
        {**a, **{k: a[k] + b[k] for k in ("tokens", "nll_sum", "bytes")}}
        for a, b in zip(rows, stats)]
    used += 1
  if rows is None:
    raise ValueError("ppl: every held-out document is empty")
  overall = {k: sum(r[k] for r in rows) for k in ("tokens", "nll_sum", "bytes")}
  return {"documents": used, "max_tokens": max_tokens,
          "buckets": [_finish(r) for r in rows if r["tokens"]], "overall": _finish(overall)}
