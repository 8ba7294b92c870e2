"""Synthetic long-range retrieval documents: passkey and key-value recall, made on demand.

Mixed in at a small share in later curriculum stages, they give the model examples where the
answer sits thousands of tokens before the question, which natural text rarely forces.

  passkey:  filler ... "The pass key is 48213. Remember it. 48213 is the pass key." ...
            filler ... "What is the pass key? The pass key is 48213."
  kv:       "k3f9a=71; k0b2c=05; ..." (pairs spread over the document between filler) then
            "Recall: k0b2c=05; k3f9a=71; ..." (queries in a shuffled order)

Document i is a pure function of (seed, i): the source has a fixed (virtual) length and needs
no storage, so it is indexed, sharded and checkpointed like any other source.
"""

from __future__ import annotations

import numpy as np

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")


def _filler(n: int) -> str:
  reps = n // len(FILLER) + 1
  return (FILLER * reps)[:max(n, 0)]


def passkey_document(rng: np.random.Generator, target_bytes: int) -> str:
  """A passkey at a random depth inside ~target_bytes of filler, asked for at the end."""
  key = "".join(str(d) for d in rng.integers(0, 10, 5))
  needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
  question = f" What is the pass key? The pass key is {key}."
  room = max(target_bytes - len(needle) - len(question), 0)
  before = int(rng.integers(0, room + 1))
  return _filler(before) + needle + _filler(room - before) + question


def kv_document(rng: np.random.Generator, target_bytes: int, max_pairs: int = 64) -> str:
  """Key-value pairs spread through ~target_bytes of filler, then all of them queried."""
  n = int(min(max_pairs, max(2, target_bytes // 64)))
  keys = [f"k{x:04x}" for x in rng.choice(1 << 16, n, replace=False)]
  vals = [f"{v:02d}" for v in rng.integers(0, 100, n)]
  pairs = [f" {k}={v};" for k, v in zip(keys, vals)]
  order = rng.permutation(n)
  recall = " Recall:" + "".join(pairs[j] for j in order)
  room = max(target_bytes - 2 * sum(len(p) for p in pairs) - len(" Recall:"), 0)
  cuts = np.sort(rng.integers(0, room + 1, n))
  gaps = np.diff(np.concatenate([[0], cuts]))
  return "".join(_filler(int(g)) + p for g, p in zip(gaps, pairs)) + _filler(room - int(cuts[-1])) + recall


class RetrievalSource:
  """`num_documents` synthetic documents of ~`target_bytes` bytes, alternating kinds.

  Args:
    target_bytes: document length in bytes (e.g. a stage's seq_len minus BOS/EOS).
    seed: documents depend only on (seed, index).
    num_documents: the virtual length (one "epoch").
    kinds: which generators to alternate ("passkey", "kv").
  """

  def __init__(self, target_bytes: int, *, seed: int = 0, num_documents: int = 1 << 16,
               kinds: tuple[str, ...] = ("passkey", "kv")):
    if target_bytes < 64:
      raise ValueError(f"retrieval documents need target_bytes >= 64, got {target_bytes}")
    bad = [k for k in kinds if k not in ("passkey", "kv")]
    if bad or not kinds:
      raise ValueError(f"retrieval kinds must be among ('passkey', 'kv'), got {kinds}")
    self.target_bytes, self.seed, self.kinds = target_bytes, seed, tuple(kinds)
    self.num_documents = num_documents
    self.lengths = np.full(num_documents, target_bytes, np.int64)

  def __len__(self) -> int:
    return self.num_documents

  def __getitem__(self, i) -> str:
    i = int(i)
    if not 0 <= i < self.num_documents:
      raise IndexError(f"document index {i} out of range for {self.num_documents} documents")
    rng = np.random.default_rng([self.seed, i])
    kind = self.kinds[i % len(self.kinds)]
    make = passkey_document if kind == "passkey" else kv_document
    return make(rng, self.target_bytes)
