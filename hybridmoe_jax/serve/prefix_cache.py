"""Prompt-prefix reuse for the hybrid cache: whole-row snapshots at prefill chunk boundaries.

Why snapshots: a KDA layer keeps one recurrent state per row (plus its conv tail), which
cannot be cut back to an earlier position the way an attention cache can. So, as in SGLang's
radix cache for Mamba-hybrid models, the state is saved at chosen points of the prefill and a
later request sharing that prefix starts from the saved point. Here the points are the
prefill chunk boundaries (n = k * P tokens): a request without a hit is fed its prompt in
chunks starting at 0, P, 2P, ..., so the row restored at k * P is the row it would have
built itself, and the chunks it still feeds are the same ones (same outputs as `generate`).
A snapshot holds every leaf of one cache row (KDA states and conv tails, MLA latents
c / k_r for all N positions, the length): `BatchEngine.row_bytes()` bytes each.

Entries are keyed by the prefix's token ids (bytes of int32 [n]); the longest cached prefix
of a prompt that leaves at least one token to feed (the first draw needs a fed token's
logits) is its hit. Memory is bounded by `capacity` entries, least recently used evicted
first. Counters: hits / misses (per looked-up request), hit_tokens (prompt tokens not fed),
inserts, evictions.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np


def _key(prompt: np.ndarray, n: int) -> bytes:
  return np.ascontiguousarray(prompt[:n], np.int32).tobytes()


class PrefixCache:
  """LRU map prefix (a multiple of `chunk` tokens) -> a cache-row snapshot.

  Args:
    chunk: P, the prefill chunk (snapshots exist only at multiples of it).
    capacity: most entries kept (>= 1).
  """

  def __init__(self, chunk: int, capacity: int):
    if capacity < 1:
      raise ValueError(f"capacity={capacity!r} is invalid: allowed an integer >= 1")
    self.chunk, self.capacity = int(chunk), int(capacity)
    self._entries: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
    self.stats = collections.Counter()

  def __len__(self) -> int:
    return len(self._entries)

  def usable(self, prompt: np.ndarray) -> int:
    """The longest boundary a prompt of T tokens may start from: k * P <= T - 1."""
    return (len(prompt) - 1) // self.chunk * self.chunk

  def lookup(self, prompt: np.ndarray) -> tuple[int, Any]:
    """-> (n, snapshot) of the longest cached prefix of `prompt` (n < T), or (0, None);
    counted as a hit or a miss, and the entry becomes the most recently used."""
    for n in range(self.usable(prompt), 0, -self.chunk):
      key = _key(prompt, n)
      if key in self._entries:
        self._entries.move_to_end(key)
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += n
        return n, self._entries[key]
    self.stats["misses"] += 1
    return 0, None

  def cached_length(self, prompt: np.ndarray) -> int:
    """Like lookup's n, without counting or reordering (for scheduling decisions)."""
    for n in range(self.usable(prompt), 0, -self.chunk):
      if _key(prompt, n) in self._entries:
        return n
    return 0

  def wants(self, prompt: np.ndarray, n: int) -> bool:
    """Whether a snapshot after the first n fed tokens of `prompt` should be taken: n is a
    boundary and not cached yet (a cached one is marked recently used instead)."""
    if n <= 0 or n % self.chunk:
      return False
    key = _key(prompt, n)
    if key in self._entries:
      self._entries.move_to_end(key)
      return False
    return True

  def insert(self, prompt: np.ndarray, n: int, snapshot) -> None:
    """Keep `snapshot` (the row after prompt[:n]), evicting the least recently used."""
    self._entries[_key(prompt, n)] = snapshot
    self._entries.move_to_end(_key(prompt, n))
    self.stats["inserts"] += 1
    while len(self._entries) > self.capacity:
      self._entries.popitem(last=False)
      self.stats["evictions"] += 1


def shared_boundary(a: np.ndarray, b: np.ndarray, chunk: int) -> int:
  """The longest common prefix of two prompts, rounded down to a multiple of `chunk` and
  left at most len(b) - 1 (what b could start from once a's prefill has passed it)."""
  n = min(len(a), len(b) - 1)
  if n <= 0:
    return 0
  diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
  common = int(diff[0]) if len(diff) else n
  return common // chunk * chunk
