"""Wall-clock timing shared by the scripts in benchmarks/: repeated calls of functions
(interleaved, so their ratios are fair on a noisy machine) and one-off phases."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable

import jax

now = time.perf_counter   # monotonic seconds: deadlines, phase boundaries


def time_fns(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
             ) -> dict[str, tuple[float, float]]:
  """{name: (seconds of the `warmup` calls, median seconds of the `repeats` calls after)}.

  The zero-argument fns are called round-robin, each round starting one later; every call is
  waited for with `jax.block_until_ready` (a no-op on non-JAX results), so asynchronous
  dispatch hides no device time.
  """
  names, times = list(fns), {name: [] for name in fns}
  for r in range(warmup + repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      t0 = now()
      jax.block_until_ready(fns[name]())
      times[name].append(now() - t0)
  return {name: (sum(ts[:warmup]), statistics.median(ts[warmup:])) for name, ts in times.items()}


def time_fn(fn: Callable[..., Any], args: tuple, repeats: int) -> tuple[float, float]:
  """-> (compile + first run seconds, median seconds of `repeats` further runs)."""
  return time_fns({"fn": lambda: fn(*args)}, repeats)["fn"]


class Stopwatch:
  """`seconds` since it started: live until `stop()` freezes it."""

  def __init__(self):
    self.start, self.end = now(), None

  def stop(self):
    self.end = now()

  @property
  def seconds(self) -> float:
    return (now() if self.end is None else self.end) - self.start


@contextlib.contextmanager
def stopwatch():
  """`with stopwatch() as sw:` ... then sw.seconds is the block's wall time."""
  sw = Stopwatch()
  try:
    yield sw
  finally:
    sw.stop()
