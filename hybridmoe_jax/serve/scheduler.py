"""Continuous batching sized to the load: requests join and leave, work is bucketed by rows.

Conventions: S slots (cache rows of requests), P the engine's prefill chunk, T a prompt's
tokens, K the most decode steps per call (`decode_steps`).

A `Scheduler` thread owns a `BatchEngine` (batch_engine.py: a cache of S + 1 rows and the
compiled calls). `start()` first compiles every call shape (`warm_up`: each decode bucket
1, 2, 4, ..., S rows and each prefill bucket; one progress line per shape) and then sets
`ready`; jobs submitted meanwhile wait in the queue. After that no job compiles anything.

Each iteration (the vLLM / JetStream / SGLang pattern, written for this cache):
  1. admission: a free slot takes the oldest waiting job; its row starts from the longest
     cached prefix of its prompt (prefix_cache.py: the row snapshot at a chunk boundary) or
     empty. With the prefix cache on, a job whose prompt shares a longer chunk-aligned
     prefix with a prompt being prefilled right now waits for that prefill (then hits)
     rather than prefilling the same tokens alongside it;
  2. prefill: up to `prefill_rows` prefilling rows get their next chunk of P tokens in one
     call (bucketed); a row whose prompt ends in that chunk draws its first token; a row at
     a chunk boundary not yet cached is snapshotted into the prefix cache;
  3. decode: every decoding row in one call of the smallest bucket holding them. While a job
     waits to join (a prompt still being prefilled, or a queued job and a free slot) the
     call makes one step, so prefill chunks interleave with decode steps; otherwise it makes
     up to K steps in one host round trip, ending early when every row has stopped or, if
     jobs are queued, as soon as one row stops (its slot is then free for them).
So a long prompt costs the running requests one chunk call per iteration, never a whole
prefill, and one request alone pays K-step calls over 1 row, not S.

Sampling is the one sampler (`infer.steps._feed_and_draw`): each row draws from its own
settings and key chain (PRNGKey(seed), split per draw), so a job's tokens equal
`Engine.generate(prompt[None], seed=seed)`'s, greedy and sampled alike, whatever it shared.

Events go to each job's `emit` from the scheduler thread: ("tokens", [ids]) per call that
drew any for it (a stop id included, last), then one ("done", "stop" | "length" |
"cancelled") or ("error", message). A cancelled job leaves its slot or the queue at the next
iteration. Each finished job gives one log line (logger "hybridmoe_jax.serve") and its
figures to `metrics` (metrics.py). `stop(drain=s)` refuses new jobs, lets running and queued
ones finish for up to s seconds, then cancels the rest.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable

import jax
import numpy as np

from hybridmoe_jax.config import is_int
from hybridmoe_jax.infer.engine import Engine
from hybridmoe_jax.serve.batch_engine import MAX_STOP_IDS, BatchEngine
from hybridmoe_jax.serve.metrics import Metrics
from hybridmoe_jax.serve.prefix_cache import PrefixCache, shared_boundary

Event = tuple[str, object]
log = logging.getLogger("hybridmoe_jax.serve")
_job_ids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Job:
  """One sequence to generate.

  Attributes:
    prompt: int32 [T] token ids (T >= 1; T + max_tokens <= the engine's max_len).
    max_tokens: tokens to draw at most.
    emit: called from the scheduler thread with each Event (must not block).
    temperature, top_k, top_p, seed: sampling (temperature 0: greedy; seed in [0, 2**32)).
    stop_tokens: at most MAX_STOP_IDS ids that end the job (emitted, then ("done", "stop")).
    name: shown in the job's log line.
  """
  prompt: np.ndarray
  max_tokens: int
  emit: Callable[[Event], None]
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: frozenset = frozenset()
  name: str = dataclasses.field(default_factory=lambda: f"job-{next(_job_ids)}")
  # Scheduler-side state.
  fed: int = 0                 # prompt tokens in its cache row so far
  cached: int = 0              # of them, taken from the prefix cache
  generated: int = 0           # tokens drawn so far
  last: int = -1               # the last drawn token, fed at the next decode call
  cancelled: bool = False
  cancel_reason: str = "cancelled"   # its finish once it leaves (a stop string: "stop")
  submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
  first_token_at: float | None = None
  emitted_at: float = 0.0      # when its last tokens were emitted


class _Stopped(Exception):
  """Raised inside warm-up when the scheduler is stopped before it is ready."""


class Scheduler:
  """Continuous batching of Jobs over S cache rows (see the module docstring).

  Args:
    engine: an infer.Engine (model, max_len = each row's capacity, prefill chunk P).
    slots: S, rows decoded together at most.
    vocab_limit: ids >= vocab_limit are never drawn (the tokenizer's vocabulary size).
    decode_steps: K, most decode steps per call (>= 1).
    prefill_rows: most prompts fed a chunk in one call (>= 1; at most prefill_rows * P
      prompt tokens per iteration, while the running requests wait one decode step).
    prefix_cache_bytes: memory for prefix snapshots (each one cache row,
      `batch.row_bytes()`); 0, or less than one row: no prefix cache (said in the log).
    progress: called with each warm-up line (default: the log).
  """

  def __init__(self, engine: Engine, *, slots: int = 8, vocab_limit: int = 0,
               decode_steps: int = 16, prefill_rows: int = 16, prefix_cache_bytes: int = 0,
               progress: Callable[[str], None] | None = None):
    for name, v, low in (("slots", slots, 1), ("decode_steps", decode_steps, 1),
                         ("prefill_rows", prefill_rows, 1),
                         ("prefix_cache_bytes", prefix_cache_bytes, 0)):
      if not is_int(v) or v < low:
        raise ValueError(f"{name}={v!r} is invalid: allowed an integer >= {low}")
    self.engine, self.slots = engine, int(slots)
    # Steps per decode call when no request is joining: may be lowered at run time (it is a
    # traced argument, at most the compiled K), e.g. by a test that needs long requests.
    self.decode_steps = int(decode_steps)
    self.batch = BatchEngine(engine, slots=self.slots, decode_steps=decode_steps,
                             prefill_rows=prefill_rows)
    self._progress = progress or log.info
    rows = prefix_cache_bytes // self.batch.row_bytes()
    self.prefix = PrefixCache(engine.prefill_chunk, rows) if rows else None
    if prefix_cache_bytes and not rows:
      self._progress(f"prefix cache off: {prefix_cache_bytes} bytes hold no cache row "
                     f"({self.batch.row_bytes()} bytes each)")
    self.metrics = Metrics()
    self._vocab_limit = np.int32(vocab_limit)
    self._rows: list[Job | None] = [None] * self.slots
    self._keys = np.zeros((self.slots, 2), np.uint32)
    self._waiting: collections.deque[Job] = collections.deque()
    self._cond = threading.Condition()
    self._stopping = self._draining = False
    self._thread: threading.Thread | None = None
    self.ready = threading.Event()
    self.compiled = (0, 0)          # (compiled so far, shapes to compile)
    self.stats = collections.Counter()

  # ---- the caller's side -------------------------------------------------------------------
  def start(self) -> "Scheduler":
    """Start the thread: warm-up, then the loop (jobs may be submitted at once)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="hybridmoe-scheduler",
                                      daemon=True)
      self._thread.start()
    return self

  def stop(self, timeout: float = 30.0, drain: float = 0.0) -> None:
    """Refuse new jobs; let the running and queued ones finish for up to `drain` seconds;
    then end the thread after its current iteration (jobs still there get ("done",
    "cancelled"))."""
    with self._cond:
      self._draining = True
    deadline = time.monotonic() + drain
    while self.busy and time.monotonic() < deadline and self._thread is not None:
      time.sleep(0.01)
    with self._cond:
      self._stopping = True
      self._cond.notify_all()
    if self._thread is not None:
      # A thread still warming up is inside a compilation that cannot be interrupted (it
      # stops after it): the daemon thread is not waited for.
      self._thread.join(timeout if self.ready.is_set() else 1.0)
      self._thread = None

  def submit(self, job: Job) -> None:
    """Queue a job (checked: a non-empty prompt that fits with its max_tokens)."""
    n = len(job.prompt)
    if n < 1 or job.max_tokens < 1 or n + job.max_tokens > self.engine.max_len:
      raise ValueError(f"job of {n} prompt tokens + max_tokens {job.max_tokens} does not fit "
                       f"the cache rows of {self.engine.max_len} tokens")
    if len(job.stop_tokens) > MAX_STOP_IDS:
      raise ValueError(f"stop_tokens: {len(job.stop_tokens)} ids, allowed at most "
                       f"{MAX_STOP_IDS}")
    with self._cond:
      if self._stopping or self._draining:
        raise RuntimeError("the scheduler is stopped")
      self._waiting.append(job)
      self._cond.notify_all()

  def cancel(self, job: Job, reason: str = "cancelled") -> None:
    """Stop generating for `job`: it leaves its slot or the queue at the next iteration
    (which this wakes), then gets ("done", reason) ("stop": its caller saw a stop string;
    the first cancel's reason counts); harmless after it has finished."""
    with self._cond:
      if not job.cancelled:
        job.cancel_reason = reason
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

  def render_metrics(self) -> str:
    """/metrics' Prometheus text."""
    return self.metrics.render(
        running=self.running, waiting=self.waiting, ready=self.ready.is_set(),
        compiled=self.compiled[0], prefix=None if self.prefix is None else self.prefix.stats,
        prefix_entries=0 if self.prefix is None else len(self.prefix))

  # ---- the scheduler thread ------------------------------------------------------------------
  def warm_up(self) -> None:
    """Compile every call shape (progress lines), then mark the scheduler ready."""
    start = time.perf_counter()

    def progress(done, total, name):
      if self._stopping:
        raise _Stopped
      self.compiled = (done, total)
      self._progress(f"warm-up: compiled {done}/{total} ({name}), "
                     f"{time.perf_counter() - start:.1f} s")

    self.batch.warm_up(self._vocab_limit, progress)
    self.ready.set()
    self._progress(f"ready: every shape compiled in {time.perf_counter() - start:.1f} s "
                   f"(decode rows {list(self.batch.decode_buckets)}, prefill rows "
                   f"{list(self.batch.prefill_buckets)})")

  def _run(self) -> None:
    try:
      if not self.ready.is_set():
        self.warm_up()
    except _Stopped:
      pass                   # the loop sees _stopping: queued jobs are cancelled
    except Exception as e:   # noqa: BLE001 -- the jobs get the error, the loop still runs
      self._progress(f"warm-up failed: {type(e).__name__}: {e}")
      self.batch.reset()
      self.ready.set()
    self._loop()

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
      self._finish(job, "cancelled")
    self._rows, self._waiting = [None] * self.slots, collections.deque()

  def _finish(self, job: Job, reason: str, message: str = "") -> None:
    """The job's last event, its log line and metrics."""
    job.emit(("error", message) if reason == "error" else ("done", reason))
    now = time.perf_counter()
    self.metrics.request_done(reason, len(job.prompt), job.cached)
    ttft = "-" if job.first_token_at is None else f"{job.first_token_at - job.submitted_at:.3f}s"
    log.info("request %s: %s, prompt %d tokens (%d cached), %d generated, ttft %s, total "
             "%.3fs", job.name, reason, len(job.prompt), job.cached, job.generated, ttft,
             now - job.submitted_at)

  def _fail_all(self, message: str) -> None:
    """A failed model call: every running job ends with the error; a fresh cache."""
    for s, job in enumerate(self._rows):
      if job is not None:
        self._finish(job, "error", message)
        self._rows[s] = None
    self.batch.reset()

  def _cancelled(self, job: Job) -> None:
    self._finish(job, job.cancel_reason)
    self.stats["cancelled"] += 1

  def _next_job(self) -> Job | None:
    """The oldest waiting job that should start now: with the prefix cache, one whose prompt
    shares a longer chunk-aligned prefix with a prompt still being fed before that boundary
    waits for it (it then starts from the snapshot instead of feeding the same tokens)."""
    with self._cond:
      for job in self._waiting:
        if not self._follows_a_prefill(job):
          self._waiting.remove(job)
          return job
    return None

  def _follows_a_prefill(self, job: Job) -> bool:
    if self.prefix is None:
      return False
    have = self.prefix.cached_length(job.prompt)
    for r in self._rows:
      if r is not None and r.fed < len(r.prompt):
        boundary = shared_boundary(r.prompt, job.prompt, self.prefix.chunk)
        if boundary > have and r.fed < boundary:
          return True
    return False

  def _admit(self) -> None:
    with self._cond:
      # Cancelled jobs leave the queue now, not when a slot frees: a queue of gone clients
      # costs nothing and does not count as waiting.
      gone = [j for j in self._waiting if j.cancelled]
      for j in gone:
        self._waiting.remove(j)
    for job in gone:
      self._cancelled(job)
    for s in range(self.slots):
      job = self._rows[s]
      if job is not None and job.cancelled:
        self._cancelled(job)
        self._rows[s] = None
    for s in range(self.slots):
      if self._rows[s] is not None:
        continue
      job = self._next_job()
      if job is None:
        break
      self._rows[s] = job
      # uint32: the dtype warm-up compiled PRNGKey for (a Python int would compile again).
      self._keys[s] = np.asarray(jax.random.PRNGKey(np.uint32(job.seed % 2**32)))
      n, snap = (0, None) if self.prefix is None else self.prefix.lookup(job.prompt)
      if snap is not None:
        self.batch.restore(s, snap)
      else:
        self.batch.clear(s)
      job.fed = job.cached = n
      self.stats["admitted"] += 1

  def _iteration(self) -> None:
    self._admit()
    p = self.engine.prefill_chunk
    prefilling = [s for s, j in enumerate(self._rows) if j is not None and j.fed < len(j.prompt)]
    prefilling = prefilling[:self.batch.prefill_buckets[-1]]
    if prefilling:
      self._prefill(prefilling, p)
    decoding = [s for s, j in enumerate(self._rows)
                if j is not None and j.fed == len(j.prompt) and j.generated]
    if decoding:
      joining = any(j is not None and j.fed < len(j.prompt) for j in self._rows) or (
          self._waiting and any(j is None for j in self._rows))
      steps = 1 if joining else min(self.decode_steps, self.batch.steps)
      self._decode(decoding, steps, bool(self._waiting))

  def _sampling(self, jobs: list[Job]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.array([j.temperature for j in jobs], np.float32),
            np.array([j.top_k for j in jobs], np.int32),
            np.array([j.top_p for j in jobs], np.float32))

  def _prefill(self, slots: list[int], p: int) -> None:
    jobs = [self._rows[s] for s in slots]
    tokens = np.zeros((len(slots), p), np.int32)
    n_valid = np.zeros(len(slots), np.int32)
    for i, job in enumerate(jobs):
      part = job.prompt[job.fed:job.fed + p]
      tokens[i, :len(part)], n_valid[i] = part, len(part)
      job.fed += len(part)
    draw = np.array([j.fed == len(j.prompt) for j in jobs])
    rows = np.asarray(slots, np.int32)
    tok, self._keys[rows] = self.batch.prefill(rows, tokens, n_valid, self._keys[rows], draw,
                                               self._sampling(jobs), self._vocab_limit)
    self.stats["prefill_calls"] += 1
    self.stats["max_rows"] = max(self.stats["max_rows"], len(slots))
    if self.prefix is not None:
      for s, job in zip(slots, jobs):
        if self.prefix.wants(job.prompt, job.fed):
          self.prefix.insert(job.prompt, job.fed, self.batch.snapshot(s))
    now = time.perf_counter()
    for i, (s, job) in enumerate(zip(slots, jobs)):
      if draw[i]:
        job.first_token_at = now
        self.metrics.first_token(now - job.submitted_at)
        self._take(s, job, [int(tok[i])], now)

  def _decode(self, slots: list[int], steps: int, exit_on_done: bool) -> None:
    jobs = [self._rows[s] for s in slots]
    rows = np.asarray(slots, np.int32)
    stop = np.full((len(slots), MAX_STOP_IDS), -1, np.int32)
    for i, job in enumerate(jobs):
      ids = sorted(job.stop_tokens)
      stop[i, :len(ids)] = ids
    out = self.batch.decode(rows, np.array([j.last for j in jobs], np.int32), self._keys[rows],
                            np.array([j.max_tokens - j.generated for j in jobs], np.int32),
                            stop, self._sampling(jobs), self._vocab_limit, steps, exit_on_done)
    self._keys[rows] = out.keys
    self.stats["decode_calls"] += 1
    self.stats["max_rows"] = max(self.stats["max_rows"], len(slots))
    now = time.perf_counter()
    for i, (s, job) in enumerate(zip(slots, jobs)):
      n = int(out.count[i])
      if n:
        self._take(s, job, out.tokens[i, :n].tolist(), now)

  def _take(self, s: int, job: Job, ids: list[int], now: float) -> None:
    """Row s drew `ids` (in order): emit them, end the job at a stop id or max_tokens."""
    first = job.generated == 0
    job.generated += len(ids)
    job.last = ids[-1]
    self.metrics.tokens(len(ids), None if first else (now - job.emitted_at) / len(ids))
    job.emitted_at = now
    self.stats["tokens"] += len(ids)
    job.emit(("tokens", ids))
    if ids[-1] in job.stop_tokens or job.generated >= job.max_tokens:
      self._rows[s] = None
      self._finish(job, "stop" if ids[-1] in job.stop_tokens else "length")
