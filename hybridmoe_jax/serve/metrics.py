"""The server's counters and latency histograms, rendered in Prometheus' text format.

`Metrics` is written by the scheduler thread and read by the /metrics route under one lock.
Exposed (prefix hybridmoe_): requests_running / requests_waiting (gauges, read from the
scheduler at scrape time), requests_total{finish="stop|length|cancelled|error"},
prompt_tokens_total, prompt_tokens_cached_total, generation_tokens_total,
generation_tokens_per_second (over the last `window_s` seconds), time_to_first_token_seconds
and time_per_output_token_seconds (histograms: cumulative buckets, _sum, _count),
prefix_cache_hits_total / _misses_total / _evictions_total / prefix_cache_entries,
compiled_functions and ready (warm-up). Format: text/plain; version=0.0.4.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import threading
import time

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
  """Cumulative-bucket histogram of seconds (Prometheus semantics: le = upper bound)."""

  def __init__(self, bounds: tuple[float, ...]):
    self.bounds = tuple(bounds)
    self.counts = [0] * (len(self.bounds) + 1)   # the last: +Inf only
    self.sum, self.count = 0.0, 0

  def observe(self, value: float, times: int = 1) -> None:
    self.counts[bisect.bisect_left(self.bounds, value)] += times
    self.sum += value * times
    self.count += times

  def lines(self, name: str) -> list[str]:
    les = [repr(b) for b in self.bounds] + ["+Inf"]
    totals = itertools.accumulate(self.counts)     # cumulative, as Prometheus buckets are
    return [f'{name}_bucket{{le="{le}"}} {n}' for le, n in zip(les, totals)] + [
        f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


class Metrics:
  """What the scheduler records (all methods thread-safe)."""

  def __init__(self, window_s: float = 10.0):
    self.lock = threading.Lock()
    self.window_s = window_s
    self.finished = collections.Counter()
    self.totals = collections.Counter()
    self.ttft = Histogram(TTFT_BUCKETS)
    self.tpot = Histogram(TPOT_BUCKETS)
    self._recent: collections.deque[tuple[float, int]] = collections.deque()

  def request_done(self, finish: str, prompt_tokens: int, cached_tokens: int) -> None:
    with self.lock:
      self.finished[finish] += 1
      self.totals["prompt_tokens"] += prompt_tokens
      self.totals["prompt_tokens_cached"] += cached_tokens

  def first_token(self, seconds: float) -> None:
    with self.lock:
      self.ttft.observe(seconds)

  def tokens(self, n: int, seconds_each: float | None) -> None:
    """n tokens drawn for one request; seconds_each: the time per token since its previous
    emission (None for a first token, which is a TTFT)."""
    now = time.monotonic()
    with self.lock:
      self.totals["generation_tokens"] += n
      self._recent.append((now, n))
      self._trim(now)      # also without scrapes: the window's entries only, never more
      if seconds_each is not None:
        self.tpot.observe(seconds_each, n)

  def _trim(self, now: float) -> None:
    """Forget the emissions older than the window (the lock held)."""
    while self._recent and self._recent[0][0] < now - self.window_s:
      self._recent.popleft()

  def tokens_per_second(self) -> float:
    now = time.monotonic()
    with self.lock:
      self._trim(now)
      return sum(n for _, n in self._recent) / self.window_s

  def render(self, *, running: int, waiting: int, ready: bool, compiled: int,
             prefix: dict | None, prefix_entries: int) -> str:
    """The whole exposition (ends with a newline)."""
    rate = self.tokens_per_second()
    p = "hybridmoe_"
    lines = []

    def metric(name, kind, help_text, samples):
      lines.append(f"# HELP {p}{name} {help_text}")
      lines.append(f"# TYPE {p}{name} {kind}")
      lines.extend(f"{p}{name}{s}" for s in samples)

    with self.lock:
      metric("requests_running", "gauge", "Requests holding a cache row.", [f" {running}"])
      metric("requests_waiting", "gauge", "Requests queued for a cache row.", [f" {waiting}"])
      metric("requests_total", "counter", "Finished requests by finish reason.",
             [f'{{finish="{k}"}} {self.finished[k]}'
              for k in ("stop", "length", "cancelled", "error")])
      for name, text in (("prompt_tokens", "Prompt tokens of finished requests."),
                         ("prompt_tokens_cached", "Prompt tokens taken from the prefix cache."),
                         ("generation_tokens", "Tokens drawn.")):
        metric(f"{name}_total", "counter", text, [f" {self.totals[name]}"])
      metric("generation_tokens_per_second", "gauge",
             f"Tokens drawn per second over the last {self.window_s:g} s.", [f" {rate!r}"])
      for name, hist, text in (
          ("time_to_first_token_seconds", self.ttft, "Submission to first token."),
          ("time_per_output_token_seconds", self.tpot, "Time between a request's tokens.")):
        lines.append(f"# HELP {p}{name} {text}")
        lines.append(f"# TYPE {p}{name} histogram")
        lines.extend(p + line for line in hist.lines(name))
    stats = prefix or {}
    for name in ("hits", "misses", "evictions"):
      metric(f"prefix_cache_{name}_total", "counter", f"Prefix cache {name}.",
             [f" {stats.get(name, 0)}"])
    metric("prefix_cache_entries", "gauge", "Snapshots held by the prefix cache.",
           [f" {prefix_entries}"])
    metric("compiled_functions", "gauge", "Scheduler functions compiled by warm-up.",
           [f" {compiled}"])
    metric("ready", "gauge", "1 once warm-up has compiled every shape.", [f" {int(ready)}"])
    return "\n".join(lines) + "\n"
