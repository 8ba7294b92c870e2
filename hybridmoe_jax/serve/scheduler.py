"""Continuous batching on one hybrid DecodeCache: requests join and leave a running batch.

Conventions: S slots (cache rows), P the engine's prefill chunk, T a prompt's tokens.

A `Scheduler` thread owns one `DecodeCache` of S rows. A submitted `Job` waits for a free
slot; then its row is cleared (`infer.engine.clear_row`) and its prompt fed P tokens per
iteration; the call that feeds its last prompt chunk draws its first token, and from then
on it feeds one token per iteration and draws the next. It leaves at a stop token, at
max_tokens, or when cancelled (a stop string seen by the caller, a client gone).
Each iteration makes at most two calls over all S rows: one [S, P] feeding the next prompt
chunk of every prefilling row, one [S, 1] feeding every decoding row; a row without work has
n_valid 0 (padding, its cache row untouched). So a long prompt costs the running decodes one
chunk call per iteration, never a whole prefill, and the engine compiles two shapes in all.

Both calls are `infer.engine.feed_and_draw_fn` (the step `Engine.generate_stream` runs with
one row): each row samples from its last real token's logits with its own settings and key
chain (PRNGKey(seed), split per draw), never depending on its neighbours, so a job's tokens
equal `Engine.generate(prompt[None], seed=seed)`'s, greedy and sampled alike.

Events go to each job's `emit` callback from the scheduler thread: ("token", id) per drawn
token (a stop token included), then one ("done", "stop" | "length" | "cancelled") or
("error", message). A cancelled job leaves its slot or the queue at the next iteration
(`stats["cancelled"]` counts them); `running` and `waiting` say how many hold slots and
wait for one.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import jax
import numpy as np

from hybridmoe_jax.config import is_int
from hybridmoe_jax.infer.engine import Engine, clear_row, feed_and_draw_fn

Event = tuple[str, object]


@dataclasses.dataclass(eq=False)
class Job:
  """One sequence to generate.

  Attributes:
    prompt: int32 [T] token ids (T >= 1; T + max_tokens <= the engine's max_len).
    max_tokens: tokens to draw at most.
    emit: called from the scheduler thread with each Event (must not block).
    temperature, top_k, top_p, seed: sampling (temperature 0: greedy).
    stop_tokens: ids that end the job (the id is emitted, then ("done", "stop")).
  """
  prompt: np.ndarray
  max_tokens: int
  emit: Callable[[Event], None]
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: frozenset = frozenset()
  # Scheduler-side state.
  fed: int = 0                 # prompt tokens cached so far
  generated: int = 0           # tokens drawn so far
  last: int = -1               # the last drawn token, fed at the next decode call
  cancelled: bool = False
  submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
  first_token_at: float | None = None


class Scheduler:
  """Continuous batching of Jobs over S cache rows (see the module docstring).

  Args:
    engine: an infer.Engine (model, max_len = each row's capacity, prefill chunk P).
    slots: S, rows decoded together.
    vocab_limit: ids >= vocab_limit are never drawn (the tokenizer's vocabulary size).
  """

  def __init__(self, engine: Engine, *, slots: int = 8, vocab_limit: int = 0):
    if not is_int(slots) or slots < 1:
      raise ValueError(f"slots={slots!r} is invalid: allowed an integer >= 1")
    self.engine, self.slots = engine, int(slots)
    self._vocab_limit = np.int32(vocab_limit)
    self._step = feed_and_draw_fn(engine.graphdef, engine.kv_block)
    self._rows: list[Job | None] = [None] * self.slots
    self._keys = np.zeros((self.slots, 2), np.uint32)
    self._waiting: collections.deque[Job] = collections.deque()
    self._cond = threading.Condition()
    self._stopping = False
    self._thread: threading.Thread | None = None
    self._cache = None
    self.stats = collections.Counter()

  # ---- the caller's side -------------------------------------------------------------------
  def start(self) -> "Scheduler":
    if self._thread is None:
      self._cache = self.engine.init_cache(self.slots)
      self._thread = threading.Thread(target=self._loop, name="hybridmoe-scheduler",
                                      daemon=True)
      self._thread.start()
    return self

  def stop(self, timeout: float = 30.0) -> None:
    """Ends the thread after its current iteration; jobs still there get ("done",
    "cancelled")."""
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join(timeout)
      self._thread = None

  def submit(self, job: Job) -> None:
    """Queue a job (checked: a non-empty prompt that fits with its max_tokens)."""
    n = len(job.prompt)
    if n < 1 or job.max_tokens < 1 or n + job.max_tokens > self.engine.max_len:
      raise ValueError(f"job of {n} prompt tokens + max_tokens {job.max_tokens} does not fit "
                       f"the cache rows of {self.engine.max_len} tokens")
    with self._cond:
      if self._stopping:
        raise RuntimeError("the scheduler is stopped")
      self._waiting.append(job)
      self._cond.notify_all()

  def cancel(self, job: Job) -> None:
    """Stop generating for `job`: it leaves its slot or the queue at the next iteration
    (which this wakes), then gets ("done", "cancelled"); harmless after it has finished."""
    with self._cond:
      job.cancelled = True
      self._cond.notify_all()

  @property
  def running(self) -> int:
    """Slots holding a job (a cancelled one holds its slot until the next iteration)."""
    return sum(r is not None for r in self._rows)

  @property
  def waiting(self) -> int:
    """Jobs queued for a slot (cancelled ones leave at the next iteration)."""
    return len(self._waiting)

  @property
  def busy(self) -> int:
    """Jobs running or waiting."""
    return self.running + self.waiting

  # ---- the scheduler thread ------------------------------------------------------------------
  def _loop(self) -> None:
    while True:
      with self._cond:
        while not self._stopping and not self._waiting and not any(self._rows):
          self._cond.wait()
        if self._stopping:
          break
      try:
        self._iteration()
      except Exception as e:   # noqa: BLE001 -- reported to every job, the loop goes on
        self._fail_all(f"{type(e).__name__}: {e}")
    for job in [r for r in self._rows if r is not None] + list(self._waiting):
      job.emit(("done", "cancelled"))
    self._rows, self._waiting = [None] * self.slots, collections.deque()

  def _fail_all(self, message: str) -> None:
    """A failed model call: every running job ends with the error; a fresh cache."""
    for s, job in enumerate(self._rows):
      if job is not None:
        job.emit(("error", message))
        self._rows[s] = None
    self._cache = self.engine.init_cache(self.slots)

  def _cancelled(self, job: Job) -> None:
    job.emit(("done", "cancelled"))
    self.stats["cancelled"] += 1

  def _admit(self) -> None:
    with self._cond:
      # Cancelled jobs leave the queue now, not when a slot frees: a queue of gone clients
      # costs nothing and does not count as waiting.
      gone = [j for j in self._waiting if j.cancelled]
      if gone:
        self._waiting = collections.deque(j for j in self._waiting if not j.cancelled)
    for job in gone:
      self._cancelled(job)
    for s in range(self.slots):
      job = self._rows[s]
      if job is not None and job.cancelled:
        self._cancelled(job)
        self._rows[s] = job = None
      # Every slot is visited (an empty queue ends only the filling, not the loop): a
      # cancelled job in a later slot must leave it too.
      while job is None:
        with self._cond:
          job = self._waiting.popleft() if self._waiting else None
        if job is None:
          break
        if job.cancelled:
          self._cancelled(job)
          job = None
          continue
        self._rows[s] = job
        self._keys[s] = np.asarray(jax.random.PRNGKey(job.seed))
        self._cache = clear_row(self._cache, np.int32(s))
        self.stats["admitted"] += 1

  def _iteration(self) -> None:
    self._admit()
    p = self.engine.prefill_chunk
    prefilling = [s for s, j in enumerate(self._rows) if j is not None and j.fed < len(j.prompt)]
    if prefilling:
      tokens = np.zeros((self.slots, p), np.int32)
      n_valid = np.zeros(self.slots, np.int32)
      for s in prefilling:
        job = self._rows[s]
        part = job.prompt[job.fed:job.fed + p]
        tokens[s, :len(part)], n_valid[s] = part, len(part)
        job.fed += len(part)
      done = [s for s in prefilling if self._rows[s].fed == len(self._rows[s].prompt)]
      self._call(tokens, n_valid, done, "prefill_calls")
    # Rows that drew their first token in the prefill call decode in the same iteration.
    decoding = [s for s, j in enumerate(self._rows)
                if j is not None and j.fed == len(j.prompt) and j.generated]
    if decoding:
      tokens = np.zeros((self.slots, 1), np.int32)
      n_valid = np.zeros(self.slots, np.int32)
      for s in decoding:
        tokens[s, 0], n_valid[s] = self._rows[s].last, 1
      self._call(tokens, n_valid, decoding, "decode_calls")

  def _call(self, tokens: np.ndarray, n_valid: np.ndarray, drawing: list[int],
            counter: str) -> None:
    """One model call; the rows in `drawing` take their drawn token."""
    draw = np.zeros(self.slots, bool)
    draw[drawing] = True
    rows = [j if j is not None else _IDLE for j in self._rows]
    temperature = np.array([j.temperature for j in rows], np.float32)
    top_k = np.array([j.top_k for j in rows], np.int32)
    top_p = np.array([j.top_p for j in rows], np.float32)
    tok, _, _, keys, self._cache = self._step(
        self.engine.state, tokens, n_valid, self._cache, self._keys, draw, temperature, top_k,
        top_p, self._vocab_limit)
    tok, self._keys = np.asarray(tok), np.array(keys)
    self.stats[counter] += 1
    self.stats["max_rows"] = max(self.stats["max_rows"], int((n_valid > 0).sum()))
    now = time.perf_counter()
    for s in drawing:
      job = self._rows[s]
      t = int(tok[s])
      job.generated += 1
      job.last = t
      if job.first_token_at is None:
        job.first_token_at = now
      job.emit(("token", t))
      self.stats["tokens"] += 1
      if t in job.stop_tokens or job.generated >= job.max_tokens:
        job.emit(("done", "stop" if t in job.stop_tokens else "length"))
        self._rows[s] = None


_IDLE = Job(np.zeros(1, np.int32), 1, lambda e: None)   # sampling settings of an idle row
