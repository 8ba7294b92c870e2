"""The scheduler's compiled calls: bucketed prefill / multi-step decode over rows of one cache.

Conventions: S slots (cache rows of requests), the cache holds S + 1 rows (row S: scratch,
never a request's), b a decode bucket (rows per decode call), q a prefill bucket (rows per
prefill call), P the prefill chunk, K the most decode steps per call, M stop ids per row.

Every call takes the rows it works on as an index vector `rows` int32 [b] into the big cache:
the rows are gathered, advanced, and scattered back (the cache is donated, so the scatter
updates it in place). Bucket padding points at the scratch row S with no work (n_valid 0 or
nothing left to draw), so it never changes a request's row, and the scratch row's own
content is never read. The shapes of a call depend only on its bucket, so warm-up compiles
each bucket once (`BatchEngine.warm_up`) and no request compiles anything afterwards:
`infer.trace_counts()` counts the traces of every function here, for the test that says so.

Sampling is `infer.steps._feed_and_draw` (split_keys=True), the one sampler of
`Engine.generate_stream` and the RL rollouts: each row draws from its last real token's
logits with its own settings and key chain (split once per draw), so a request's tokens are
those of `Engine.generate(prompt[None], seed=seed)` whatever bucket or neighbours it had.

Decode: up to `n_steps` (<= K, a traced value) steps in one `lax.while_loop`; a row stops
at a stop id or when its `remaining` budget reaches 0 (it then feeds nothing more: its cache
row holds exactly the tokens fed), and the loop ends when every row has stopped, or, with
`exit_on_done`, as soon as any row stops (a waiting request can take its slot).
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe_jax.infer.engine import Engine, row_sampling
from hybridmoe_jax.infer.sampling import SamplingConfig
from hybridmoe_jax.infer.steps import TRACES, _feed_and_draw, clear_row
from hybridmoe_jax.model.cache import DecodeCache

MAX_STOP_IDS = 8     # stop ids per request (EOS + a chat format's end-of-turn need 2)

def buckets(limit: int) -> tuple[int, ...]:
  """Row counts compiled for a call of at most `limit` rows: 1, 2, 4, ... < limit, limit."""
  return tuple(1 << i for i in range((limit - 1).bit_length())) + (limit,)


def bucket_for(n: int, sizes: tuple[int, ...]) -> int:
  """The smallest bucket holding n rows."""
  return next(b for b in sizes if b >= n)


class Decoded(NamedTuple):
  """One decode call's result (host arrays)."""
  tokens: np.ndarray   # int32 [b, K]: row r's drawn ids are tokens[r, :count[r]]
  count: np.ndarray    # int32 [b]
  keys: np.ndarray     # uint32 [b, 2] advanced keys


def _gather(cache: DecodeCache, rows) -> DecodeCache:
  return jax.tree.map(lambda x: x[rows], cache)


def _scatter(cache: DecodeCache, rows, part: DecodeCache) -> DecodeCache:
  return jax.tree.map(lambda x, y: x.at[rows].set(y), cache, part)


def _prefill(graphdef, kv_block, state, cache, rows, tokens, n_valid, keys, draw, temperature,
             top_k, top_p, vocab_limit):
  """rows int32 [q], tokens int32 [q, P], n_valid int32 [q], keys uint32 [q, 2], draw bool
  [q] (rows whose prompt ends in this chunk draw their first token), sampling [q] ->
  (token int32 [q], keys [q, 2], cache)."""
  TRACES["prefill"] += 1
  out = _feed_and_draw(graphdef, state, tokens, n_valid, _gather(cache, rows), keys, draw,
                       temperature, top_k, top_p, vocab_limit, kv_block=kv_block,
                       split_keys=True)
  return out.token, out.keys, _scatter(cache, rows, out.cache)


def _decode(graphdef, kv_block, max_steps, state, cache, rows, last, keys, remaining, stop,
            temperature, top_k, top_p, vocab_limit, n_steps, exit_on_done):
  """rows int32 [b], last int32 [b] (each row's last drawn token, fed first), keys [b, 2],
  remaining int32 [b] (tokens a row may still draw; 0: no work), stop int32 [b, M] (-1
  padded), sampling [b], n_steps int32 <= K, exit_on_done bool ->
  (tokens int32 [b, K], count int32 [b], keys, cache)."""
  TRACES["decode"] += 1
  b = rows.shape[0]
  part = _gather(cache, rows)
  out = jnp.full((b, max_steps), -1, jnp.int32)

  def cond(carry):
    i, _, active, _, _, _, _, ended = carry
    return (i < n_steps) & jnp.any(active) & ~(exit_on_done & ended)

  def body(carry):
    i, tok, active, left, out, keys, part, _ = carry
    drawn = _feed_and_draw(graphdef, state, tok[:, None], active.astype(jnp.int32), part,
                           keys, active, temperature, top_k, top_p, vocab_limit,
                           kv_block=kv_block, split_keys=True)
    out = out.at[:, i].set(jnp.where(active, drawn.token, -1))
    left = left - active.astype(jnp.int32)
    stops = jnp.any(drawn.token[:, None] == stop, axis=1) | (left <= 0)
    ended = jnp.any(active & stops)
    tok = jnp.where(active, drawn.token, tok)
    return i + 1, tok, active & ~stops, left, out, drawn.keys, drawn.cache, ended

  carry = (jnp.int32(0), last, remaining > 0, remaining, out, keys, part, jnp.bool_(False))
  _, _, _, left, out, keys, part, _ = jax.lax.while_loop(cond, body, carry)
  return out, remaining - left, keys, _scatter(cache, rows, part)


@functools.lru_cache(maxsize=None)
def _model_calls(graphdef, kv_block: int, max_steps: int):
  """(prefill, decode) jitted for one model graph: schedulers of the same model share their
  compilations (the graphdef is closed over, not hashed per call)."""
  donate = dict(donate_argnames=("cache",))
  return (jax.jit(functools.partial(_prefill, graphdef, kv_block), **donate),
          jax.jit(functools.partial(_decode, graphdef, kv_block, max_steps), **donate))


@jax.jit
def _snapshot(cache, row):
  """One row of the cache (every leaf's [row]): a prefix-cache entry."""
  TRACES["snapshot"] += 1
  return jax.tree.map(lambda x: x[row], cache)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _restore(cache, row, snap):
  """The cache with row `row` set to a snapshot."""
  TRACES["restore"] += 1
  return jax.tree.map(lambda x, y: x.at[row].set(y), cache, snap)


class BatchEngine:
  """The compiled calls of one model over a cache of `slots` + 1 rows (see the module
  docstring).

  Args:
    engine: an infer.Engine (model, max_len, prefill chunk P, kv_block).
    slots: S, rows for requests (decode buckets: `buckets(S)`).
    decode_steps: K >= 1, most decode steps per call.
    prefill_rows: most rows per prefill call (prefill buckets: `buckets(min(it, S))`).
  """

  def __init__(self, engine: Engine, *, slots: int, decode_steps: int = 16,
               prefill_rows: int = 16):
    self.engine, self.slots, self.steps = engine, int(slots), int(decode_steps)
    self.scratch = self.slots
    self.decode_buckets = buckets(self.slots)
    self.prefill_buckets = buckets(min(int(prefill_rows), self.slots))
    self._prefill, self._decode = _model_calls(engine.graphdef, engine.kv_block, self.steps)
    self.cache = engine.init_cache(self.slots + 1)
    self.calls = collections.Counter()    # (kind, bucket) -> calls since warm-up

  def reset(self) -> None:
    """A fresh cache (after a failed call: the donated one may be gone)."""
    self.cache = self.engine.init_cache(self.slots + 1)

  # ---- calls -------------------------------------------------------------------------------
  def prefill(self, rows: np.ndarray, tokens: np.ndarray, n_valid: np.ndarray,
              keys: np.ndarray, draw: np.ndarray, sampling: tuple, vocab_limit
              ) -> tuple[np.ndarray, np.ndarray]:
    """Feed one chunk to q <= max bucket rows (args as `_prefill`, unpadded) -> (token int32
    [q], keys uint32 [q, 2]); pads to the bucket with scratch rows."""
    q = len(rows)
    size = bucket_for(q, self.prefill_buckets)
    self.calls["prefill", size] += 1
    pad = lambda x, v=0: _pad(x, size, v)  # noqa: E731
    tok, keys_out, self.cache = self._prefill(
        self.engine.state, self.cache, pad(rows, self.scratch), pad(tokens), pad(n_valid),
        pad(keys), pad(draw), *(pad(x, 1) for x in sampling), vocab_limit)
    return np.asarray(tok)[:q], np.array(keys_out)[:q]

  def decode(self, rows: np.ndarray, last: np.ndarray, keys: np.ndarray,
             remaining: np.ndarray, stop: np.ndarray, sampling: tuple, vocab_limit,
             n_steps: int, exit_on_done: bool) -> Decoded:
    """Up to n_steps decode steps of b rows (args as `_decode`, unpadded) -> Decoded."""
    b = len(rows)
    size = bucket_for(b, self.decode_buckets)
    self.calls["decode", size] += 1
    pad = lambda x, v=0: _pad(x, size, v)  # noqa: E731
    out, count, keys_out, self.cache = self._decode(
        self.engine.state, self.cache, pad(rows, self.scratch), pad(last), pad(keys),
        pad(remaining), pad(stop, -1), *(pad(x, 1) for x in sampling), vocab_limit,
        np.int32(n_steps), np.bool_(exit_on_done))
    return Decoded(np.asarray(out)[:b], np.asarray(count)[:b], np.array(keys_out)[:b])

  def snapshot(self, row: int):
    """A copy of cache row `row` (device arrays, one row's bytes)."""
    return _snapshot(self.cache, np.int32(row))

  def restore(self, row: int, snap) -> None:
    self.cache = _restore(self.cache, np.int32(row), snap)

  def clear(self, row: int) -> None:
    self.cache = clear_row(self.cache, np.int32(row))

  def row_bytes(self) -> int:
    """Bytes of one snapshot (every leaf's one row)."""
    return sum(int(x[0].size) * x.dtype.itemsize for x in jax.tree.leaves(self.cache))

  def warm_up(self, vocab_limit, progress=None) -> int:
    """Compile every bucket of every call (each run on scratch rows only: no request's row
    changes) -> the number of compiled functions; progress(done, total, name) after each."""
    # jax.random.PRNGKey compiles on its first call too: a request's key must not.
    steps = [("seed", lambda: jax.random.PRNGKey(np.uint32(0))),
             ("clear", lambda: self.clear(self.scratch)),
             ("snapshot", lambda: self.snapshot(self.scratch)),
             ("restore", lambda: self.restore(self.scratch, self.snapshot(self.scratch)))]
    p = self.engine.prefill_chunk
    for q in self.prefill_buckets:
      steps.append((f"prefill rows={q}", functools.partial(
          self.prefill, np.full(q, self.scratch, np.int32), np.zeros((q, p), np.int32),
          np.zeros(q, np.int32), np.zeros((q, 2), np.uint32), np.zeros(q, bool),
          row_sampling(SamplingConfig(), q), vocab_limit)))
    for b in self.decode_buckets:
      steps.append((f"decode rows={b}", functools.partial(
          self.decode, np.full(b, self.scratch, np.int32), np.zeros(b, np.int32),
          np.zeros((b, 2), np.uint32), np.zeros(b, np.int32),
          np.full((b, MAX_STOP_IDS), -1, np.int32), row_sampling(SamplingConfig(), b),
          vocab_limit, 1, False)))
    for i, (name, fn) in enumerate(steps):
      jax.block_until_ready(fn())
      if progress is not None:
        progress(i + 1, len(steps), name)
    jax.block_until_ready(self.cache)
    self.calls.clear()
    return len(steps)


def _pad(x: np.ndarray, size: int, value=0) -> np.ndarray:
  """x [n, ...] padded on axis 0 to [size, ...] with `value`."""
  x = np.asarray(x)
  if len(x) == size:
    return x
  return np.concatenate([x, np.full((size - len(x),) + x.shape[1:], value, x.dtype)])
