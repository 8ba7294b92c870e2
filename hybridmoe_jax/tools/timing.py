"""Wall-clock timing shared by the scripts in benchmarks/: repeated calls of functions
(interleaved, so ratios between them are fair on a noisy machine) and one-off phases."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator

import jax

now = time.perf_counter   # seconds on a monotonic clock: deadlines, phase boundaries


@dataclasses.dataclass
class Timing:
  """first: seconds of the warm-up calls (compile + first run); times: one per timed call."""
  first: float
  times: list[float]

  @property
  def median(self) -> float:
    return statistics.median(self.times)


def _timed(fn: Callable[[], Any]) -> float:
  t0 = now()
  jax.block_until_ready(fn())
  return now() - t0


def time_fns(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
             ) -> dict[str, Timing]:
  """{name: Timing} of `warmup` then `repeats` calls of each zero-argument fn, round-robin
  (each round starting one function later).

  Every call is waited for with `jax.block_until_ready` (a no-op on non-JAX results), so
  asynchronous dispatch does not hide device time; interleaving spreads the machine's noise
  over all the functions alike.
  """
  first = {name: 0.0 for name in fns}
  for _ in range(warmup):
    for name, fn in fns.items():
      first[name] += _timed(fn)
  times, names = {name: [] for name in fns}, list(fns)
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      times[name].append(_timed(fns[name]))
  return {name: Timing(first[name], times[name]) for name in fns}


def time_fn(fn: Callable[..., Any], args: tuple, repeats: int) -> tuple[float, float]:
  """-> (compile + first run seconds, median seconds of `repeats` further runs)."""
  t = time_fns({"fn": lambda: fn(*args)}, repeats)["fn"]
  return t.first, t.median


class Stopwatch:
  """Seconds since it started; `seconds` is live until `stop()` freezes it."""

  def __init__(self):
    self.start, self.end = now(), None

  def stop(self) -> float:
    self.end = now()
    return self.seconds

  @property
  def seconds(self) -> float:
    return (now() if self.end is None else self.end) - self.start


@contextlib.contextmanager
def stopwatch() -> Iterator[Stopwatch]:
  """`with stopwatch() as sw:` times the block; sw.seconds after it is the block's wall time."""
  sw = Stopwatch()
  try:
    yield sw
  finally:
    sw.stop()
