"""Wall-clock timing of jitted functions, shared by the scripts in benchmarks/."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


def time_fn(fn: Callable[..., Any], args: tuple, repeats: int) -> tuple[float, float]:
  """-> (compile + first run seconds, median seconds of `repeats` further runs).

  Every call is waited for with `jax.block_until_ready`, so asynchronous dispatch does not
  hide device time.
  """
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return first, statistics.median(times)
