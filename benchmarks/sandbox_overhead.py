"""Per-call cost of the RL code sandbox: kernel namespaces vs the audit-hook-only opt-out.

Each call is what the code environment does per answer: `run_calls` of a two-function
solution on 10 tests (wall clock from the call to its result, parent side, CPU time of the
parent and its children). The two modes alternate call by call (so load drifts hit both
alike), after one warm-up call each (the namespaced probe included); the median of
--calls per mode is kept, and ratio = namespaces / audit-hook.

  python benchmarks/sandbox_overhead.py [--calls 41]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from hybridmoe_jax.rl import sandbox  # pylint: disable=g-import-not-at-top

SOLUTION = "def f0(xs):\n  return sum(x for x in xs if x > 0)\n\n" \
           "def f1(xs):\n  return [2 * x for x in xs]\n"
CALLS = [(f"f{i % 2}", [[i, -i, 3]]) for i in range(10)]
_REF: dict = {}
exec(SOLUTION, _REF)  # pylint: disable=exec-used (our own text: the expected values)
EXPECTED = [_REF[name](*args) for name, args in CALLS]


def _one(limits: sandbox.SandboxLimits) -> tuple[float, float]:
  """(wall seconds, CPU seconds of this process and its children) of one run_calls."""
  t0, c0 = time.perf_counter(), os.times()
  res = sandbox.run_calls(SOLUTION, CALLS, EXPECTED, limits)
  t1, c1 = time.perf_counter(), os.times()
  assert res.pass_rate == 1.0, (res.passed, res.run.stderr_tail)
  cpu = sum(c1[:4]) - sum(c0[:4])
  return t1 - t0, cpu


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--calls", type=int, default=41)
  args = parser.parse_args()
  warnings.simplefilter("ignore", RuntimeWarning)   # the opt-out's "not a boundary" warning
  modes = {m: sandbox.SandboxLimits(isolation=m) for m in sandbox.ISOLATIONS}
  samples: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
  for m, limits in modes.items():
    _one(limits)
  for _ in range(args.calls):
    for m, limits in modes.items():
      samples[m].append(_one(limits))
  med = {m: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s))
         for m, s in samples.items()}
  ns, hook = med["namespaces"], med["audit-hook"]
  print(json.dumps({
      "bench": "sandbox_overhead", "calls": args.calls, "tests_per_call": len(CALLS),
      "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}",
      "namespaces_wall_ms": round(ns[0] * 1e3, 1), "audit_hook_wall_ms": round(hook[0] * 1e3, 1),
      "ratio_wall": round(ns[0] / hook[0], 2), "overhead_wall_ms": round((ns[0] - hook[0]) * 1e3, 1),
      "namespaces_cpu_ms": round(ns[1] * 1e3, 1), "audit_hook_cpu_ms": round(hook[1] * 1e3, 1),
      "isolation_notes": list(sandbox.isolation().notes)}))


if __name__ == "__main__":
  main()
