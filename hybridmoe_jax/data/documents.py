"""Documents -> token records: the tokenization step of the data pipelines.

A document is a str (or a `data.retrieval.Document`, a str naming answer spans), an int32
array of token ids from prepared shards (`record_sources.py`: passed through, not
re-tokenized), or None where `sources.SafeSource` skipped one; a record is {"tokens": int32 [BOS, ids..., EOS]} and,
when asked, "loss_weights" float32 [n].
"""

from __future__ import annotations

import functools

import numpy as np


def _tokenize(text: str | None, tokenizer, loss_weights: bool) -> dict[str, np.ndarray] | None:
  # BOS gives the first token of a document something to be predicted from; EOS teaches the
  # model where documents end (segment ids only tell the attention masks). A document with
  # answer spans (data.retrieval.Document) is encoded piece by piece at the span edges, so
  # each answer character lands in tokens of its own (exact for bytes; a BPE may split the
  # text a little differently than in one piece). Padding gets weight 0 in the packer.
  if text is None:  # SafeSource could not load it; filtered out below
    return None
  if isinstance(text, np.ndarray):  # prepared token shards: already [BOS, ids..., EOS]
    out = {"tokens": text.astype(np.int32)}
    if loss_weights:
      out["loss_weights"] = np.ones(len(text), np.float32)
    return out
  spans = getattr(text, "answer_spans", ()) if loss_weights else ()
  w = float(getattr(text, "answer_weight", 1.0))
  parts, weights, prev = [], [], 0
  for a, b in spans:
    parts += [tokenizer.encode(str(text[prev:a]), bos=not parts),
              tokenizer.encode(str(text[a:b]))]
    weights += [1.0, w]
    prev = b
  parts.append(tokenizer.encode(str(text[prev:]), bos=not parts, eos=True))
  weights.append(1.0)
  out = {"tokens": np.concatenate(parts).astype(np.int32)}
  if loss_weights:
    out["loss_weights"] = np.concatenate([np.full(len(p), wt, np.float32)
                                          for p, wt in zip(parts, weights)])
  return out


def _not_none(x) -> bool:
  return x is not None


def tokenize_documents(ds, tokenizer, loss_weights: bool = False):
  """grain MapDataset of documents (str, or None where SafeSource skipped one) -> IterDataset
  of {"tokens": int32 [BOS, ids..., EOS]}, the skipped ones dropped (grain's filter keeps the
  iterator state's meaning, so a resumed run skips the same documents).

  loss_weights: also give each document "loss_weights" float32 [n]: 1 per token, the
  document's `answer_weight` on the tokens of its `answer_spans` (retrieval documents)."""
  fn = functools.partial(_tokenize, tokenizer=tokenizer, loss_weights=loss_weights)
  ds = ds.map(fn).to_iter_dataset()
  return ds.filter(_not_none)
