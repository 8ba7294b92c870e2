"""Write small Python functions from a spec; the answer runs against unit tests in the sandbox.

Level L asks for L + 1 functions f0 .. fL of one argument `xs` (a list of ints), each drawn
from a table of specs with random parameters (sum above a threshold, running sums, clamp,
...). The prompt shows two examples per function; `run_tests(code)` runs the code on those
examples in the sandbox and reports per function. The answer (the code of all functions,
optionally in a ``` fence) runs against 5 hidden tests per function, and the reward is the
hidden pass rate. Expected values are computed here by reference implementations and never
reach the sandbox. horizon(level) = L + 1: the oracle writes one function at a time and
checks each with run_tests before answering.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable

import numpy as np

from hybridmoe_jax.rl import sandbox
from hybridmoe_jax.rl.envs.base import Answer, Environment, Tool, ToolCall, register_env

VISIBLE_PER_FN = 2
HIDDEN_PER_FN = 5
_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_]*\n(.*?)\n?```\s*$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class _Spec:
  """One function: its spec sentence, the reference, and the oracle's body lines."""
  text: str
  ref: Callable[[list], object]
  body: str


def _draw_spec(rng: np.random.Generator, kind: int) -> _Spec:
  a, b = int(rng.integers(-5, 6)), int(rng.integers(2, 6))
  if kind == 0:
    return _Spec(f"return the sum of the elements of xs greater than {a}",
                 lambda xs: sum(x for x in xs if x > a), f"return sum(x for x in xs if x > {a})")
  if kind == 1:
    return _Spec(f"return a new list with every element of xs multiplied by {a}",
                 lambda xs: [x * a for x in xs], f"return [x * {a} for x in xs]")
  if kind == 2:
    return _Spec(f"return how many elements of xs are divisible by {b}",
                 lambda xs: sum(1 for x in xs if x % b == 0),
                 f"return sum(1 for x in xs if x % {b} == 0)")
  if kind == 3:
    return _Spec(f"return the largest element of xs, or {a} if xs is empty",
                 lambda xs: max(xs) if xs else a, f"return max(xs) if xs else {a}")
  if kind == 4:
    def running(xs):
      out, total = [], 0
      for x in xs:
        total += x
        out.append(total)
      return out
    return _Spec("return the running sums of xs (element i is xs[0] + ... + xs[i])", running,
                 "out, total = [], 0\n  for x in xs:\n    total += x\n    out.append(total)\n"
                 "  return out")
  if kind == 5:
    return _Spec("return the distinct elements of xs sorted from largest to smallest",
                 lambda xs: sorted(set(xs), reverse=True), "return sorted(set(xs), reverse=True)")
  if kind == 6:
    lo, hi = a, a + 2 * b
    return _Spec(f"return a new list with each element of xs clamped to [{lo}, {hi}]",
                 lambda xs: [min(max(x, lo), hi) for x in xs],
                 f"return [min(max(x, {lo}), {hi}) for x in xs]")
  return _Spec("return xs[0] - xs[1] + xs[2] - xs[3] + ... (0 for an empty list)",
               lambda xs: sum(x if i % 2 == 0 else -x for i, x in enumerate(xs)),
               "return sum(x if i % 2 == 0 else -x for i, x in enumerate(xs))")


_NUM_KINDS = 8


@dataclasses.dataclass(frozen=True)
class CodeTask:
  specs: tuple[_Spec, ...]
  visible: tuple[tuple[int, list, object], ...]     # (function index, xs, expected)
  hidden: tuple[tuple[int, list, object], ...]

  def source(self, upto: int) -> str:
    """The oracle's code for f0 .. f{upto - 1}."""
    return "\n\n".join(f"def f{i}(xs):\n  {s.body}\n" for i, s in enumerate(self.specs[:upto]))


def _draw_inputs(rng: np.random.Generator, count: int) -> list[list[int]]:
  return [[int(v) for v in rng.integers(-20, 21, size=int(rng.integers(0, 9)))]
          for _ in range(count)]


def strip_fence(text: str) -> str:
  """The code inside a ```...``` fence if the whole answer is one, else the text."""
  m = _FENCE.match(text)
  return m.group(1) if m else text


class CodeEnv(Environment):
  """Functions from specs, checked by unit tests in `rl.sandbox`; reward = pass rate."""

  name = "code"
  max_level = 15

  def __init__(self, *, limits: sandbox.SandboxLimits | None = None, **kwargs):
    """Args:
      limits: SandboxLimits for every run (default 2 s wall, 1 CPU s, 256 MB, kernel
        namespaces).
      **kwargs: Environment's (extra_turns, extra_tools).

    Raises:
      sandbox.SandboxUnavailable: the limits ask for namespaces (the default) and this
        kernel refuses them: one line naming what failed and the opt-out,
        SandboxLimits(isolation="audit-hook"). Checked here, before any episode runs.
    """
    super().__init__(**kwargs)
    if limits is not None and not isinstance(limits, sandbox.SandboxLimits):
      raise ValueError(f"code: limits = {limits!r}: allowed a SandboxLimits or None")
    self.limits = limits or sandbox.SandboxLimits()
    sandbox.require_isolation(self.limits)

  def horizon(self, level: int) -> int:
    return self.check_level(level) + 1

  def _make_task(self, rng, level):
    n = level + 1
    kinds = rng.permutation(_NUM_KINDS)[:n] if n <= _NUM_KINDS else \
        rng.integers(_NUM_KINDS, size=n)
    specs = tuple(_draw_spec(rng, int(k)) for k in kinds)
    visible, hidden = [], []
    for i, spec in enumerate(specs):
      for xs in _draw_inputs(rng, VISIBLE_PER_FN):
        visible.append((i, xs, spec.ref(list(xs))))
      for xs in _draw_inputs(rng, HIDDEN_PER_FN):
        hidden.append((i, xs, spec.ref(list(xs))))
    return CodeTask(specs, tuple(visible), tuple(hidden))

  def _prompt(self, task):
    lines = ["Write these Python functions; xs is a list of ints."]
    for i, spec in enumerate(task.specs):
      examples = "; ".join(f"f{i}({json.dumps(xs)}) == {json.dumps(want)}"
                           for j, xs, want in task.visible if j == i)
      lines.append(f"- f{i}(xs): {spec.text}. Examples: {examples}")
    lines.append("run_tests runs code on the examples. Answer with the code of all the "
                 "functions.")
    return "\n".join(lines)

  def _run(self, task, code: str, tests) -> sandbox.CallsResult:
    calls = [(f"f{i}", [xs]) for i, xs, _ in tests]
    return sandbox.run_calls(code, calls, [want for _, _, want in tests], self.limits)

  def _tools(self, task):
    def run_tests(argument: str) -> str:
      result = self._run(task, strip_fence(argument), task.visible)
      lines = []
      for i in range(len(task.specs)):
        flags = [ok for (j, _, _), ok in zip(task.visible, result.passed) if j == i]
        lines.append(f"f{i}: {sum(flags)}/{len(flags)} examples pass")
      run = result.run
      if run.killed:
        lines.append(f"killed: {run.killed} {run.detail}".rstrip())
      elif run.stderr_tail.strip():
        lines.append("stderr: " + run.stderr_tail.strip().splitlines()[-1][:300])
      return "\n".join(lines)
    return [Tool("run_tests", "runs Python code (the functions) on the examples of the task "
                 "in a sandbox; reports the passing examples per function.", run_tests)]

  def _score(self, task, answer):
    result = self._run(task, strip_fence(answer), task.hidden)
    info = {"passed": result.num_passed, "total": len(result.passed),
            "killed": result.run.killed, "detail": result.run.detail}
    if result.run.killed in ("timeout", "cpu"):
      info["finish_reason"] = "timeout"
    return result.pass_rate, info

  def _oracle(self, task):
    n = len(task.specs)
    return [ToolCall("run_tests", task.source(i + 1)) for i in range(n)] + \
        [Answer(task.source(n))]


register_env("code", CodeEnv)
