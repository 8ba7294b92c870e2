"""Per-call cost of the RL code sandbox: kernel namespaces vs the audit-hook-only opt-out.

Each call is what the code environment does per answer: `run_calls` of a two-function
solution on 10 tests (wall clock from the call to its result, parent side; CPU time of the
parent and its children, in the kernel's 10 ms ticks). The two modes alternate call by
call (benchmarks/_timing.time_fns: load drifts hit both alike) after one warm-up call each and
the namespaced probe; the median of --calls per mode is kept, ratio = namespaces /
audit-hook.

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
import warnings

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from hybridmoe_jax.rl import sandbox  # pylint: disable=g-import-not-at-top
from benchmarks._timing import time_fns  # pylint: disable=g-import-not-at-top

SOLUTION = "def f0(xs):\n  return sum(x for x in xs if x > 0)\n\n" \
           "def f1(xs):\n  return [2 * x for x in xs]\n"
CALLS = [(f"f{i % 2}", [[i, -i, 3]]) for i in range(10)]
_REF: dict = {}
exec(SOLUTION, _REF)  # pylint: disable=exec-used (our own text: the expected values)
EXPECTED = [_REF[name](*args) for name, args in CALLS]


def _call(limits: sandbox.SandboxLimits, cpu: list[float]) -> None:
  """One run_calls; appends the CPU seconds of this process and its children to `cpu`."""
  c0 = os.times()
  res = sandbox.run_calls(SOLUTION, CALLS, EXPECTED, limits)
  c1 = os.times()
  assert res.pass_rate == 1.0, (res.passed, res.run.stderr_tail)
  cpu.append(sum(c1[:4]) - sum(c0[:4]))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--calls", type=int, default=41)
  args = parser.parse_args()
  warnings.simplefilter("ignore", RuntimeWarning)   # the opt-out's "not a boundary" warning
  sandbox.isolation()   # the namespaced probe, outside the timings
  cpu: dict[str, list[float]] = {m: [] for m in sandbox.ISOLATIONS}
  fns = {m: (lambda m=m: _call(sandbox.SandboxLimits(isolation=m), cpu[m]))
         for m in sandbox.ISOLATIONS}
  wall = {m: median for m, (_, median) in time_fns(fns, repeats=args.calls).items()}
  cpu_med = {m: statistics.median(c[1:]) for m, c in cpu.items()}   # [0]: the warm-up
  ns, hook = "namespaces", "audit-hook"
  print(json.dumps({
      "bench": "sandbox_overhead", "calls": args.calls, "tests_per_call": len(CALLS),
      "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}",
      "namespaces_wall_ms": round(wall[ns] * 1e3, 1),
      "audit_hook_wall_ms": round(wall[hook] * 1e3, 1),
      "ratio_wall": round(wall[ns] / wall[hook], 2),
      "overhead_wall_ms": round((wall[ns] - wall[hook]) * 1e3, 1),
      "namespaces_cpu_ms": round(cpu_med[ns] * 1e3, 1),
      "audit_hook_cpu_ms": round(cpu_med[hook] * 1e3, 1),
      "isolation_notes": list(sandbox.isolation().notes)}))


if __name__ == "__main__":
  main()
