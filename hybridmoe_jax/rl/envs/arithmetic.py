"""Multi-step arithmetic with a calculator tool.

The task is a chain of level + 1 operations on integers too large to do in one's head:
    x0 = 4821
    x1 = x0 * 377
    x2 = x1 - 9181
    ...
and the answer is x_n, checked exactly (an optional sign and decimal digits, equal in value).
horizon(level) = level + 1: the oracle calls the calculator once per operation (>= 2 from
level 1) with the previous value written out, then answers.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from hybridmoe_jax.rl.envs.base import Answer, Environment, ToolCall, register_env
from hybridmoe_jax.rl.envs.calculator import CALCULATOR, evaluate

_INT = re.compile(r"[+-]?\d{1,80}")
# Values are kept below this so every step stays within the calculator's bounds and the
# numbers stay short enough for a small model's context.
_SOFT_MAX = 10**12


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  start: int
  ops: tuple[tuple[str, int], ...]      # (operator, operand) per step
  values: tuple[int, ...]               # x0 .. xn

  @property
  def target(self) -> int:
    return self.values[-1]


def _draw_op(rng: np.random.Generator, x: int) -> tuple[str, int]:
  """One operation; multiplication only while the value is small, floor division and
  modulo by 2..97 keep values from growing past _SOFT_MAX."""
  choices = ["+", "-", "*", "//", "%"] if abs(x) < _SOFT_MAX // 1000 else ["+", "-", "//"]
  op = choices[int(rng.integers(len(choices)))]
  if op in "+-":
    return op, int(rng.integers(100, 10_000))
  if op == "*":
    return op, int(rng.integers(11, 1000))
  # Modulo by a small number would collapse the chain to tiny values: use 3-digit divisors.
  return op, int(rng.integers(2, 98)) if op == "//" else int(rng.integers(101, 1000))


class ArithmeticEnv(Environment):
  """Chained integer arithmetic; the `calculator` tool evaluates one expression per call."""

  name = "arithmetic"
  max_level = 64

  def horizon(self, level: int) -> int:
    return self.check_level(level) + 1

  def _make_task(self, rng, level):
    x = int(rng.integers(1000, 100_000))
    values, ops = [x], []
    for _ in range(level + 1):
      op, b = _draw_op(rng, x)
      x = evaluate(f"{x} {op} {b}")
      ops.append((op, b))
      values.append(x)
    return ArithmeticTask(values[0], tuple(ops), tuple(values))

  def _prompt(self, task):
    n = len(task.ops)
    lines = [f"x0 = {task.start}"]
    lines += [f"x{i + 1} = x{i} {op} {b}" for i, (op, b) in enumerate(task.ops)]
    if self.brief:
      return "\n".join(lines + [f"x{n}?"])
    return (f"Compute x{n} exactly. // is floor division and % is the remainder, as in "
            "Python. Use the calculator for each step, then answer with the integer only.\n"
            + "\n".join(lines))

  def _tools(self, task):
    return [CALCULATOR]

  def _score(self, task, answer):
    text = answer.strip()
    if not _INT.fullmatch(text):
      return 0.0, {"checker": "not an integer"}
    return float(int(text) == task.target), {"target": task.target}

  def _oracle(self, task):
    calls = [ToolCall("calculator", f"{x} {op} {b}")
             for x, (op, b) in zip(task.values, task.ops)]
    return calls + [Answer(str(task.target))]


register_env("arithmetic", ArithmeticEnv)
