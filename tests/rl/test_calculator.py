"""The calculator: Python's integer semantics inside its grammar, errors as text outside it."""

import re

import pytest

from hybridmoe_jax.rl.envs import calculator
from hybridmoe_jax.rl.envs.calculator import CalcError, calculate, evaluate


@pytest.mark.parametrize("expr", ["1 + 2 * 3", "(1 + 2) * 3", "-7 // 2", "-7 % 3", "7 % -3",
                                  "--5", "+(4)", " 12 *(3- 5) // 4 % 7 ", "0", "10 - 3 - 2",
                                  "100 // 7 // 3", "2 * -3"])
def test_matches_python_integer_semantics(expr):
  assert evaluate(expr) == eval(expr)  # the test's reference only; the module never evals


@pytest.mark.parametrize("expr, fragment", [
    ("__import__('os')", "unexpected character '_'"),
    ("2 ** 100000", "'**' (power)"),
    ("7 / 2", "use // for integer division"),
    ("1.5 + 1", "unexpected character '.'"),
    ("abs(3)", "unexpected character 'a'"),
    ("(1 + 2", "expected ')'"),
    ("1 +", "expected an integer or '('"),
    ("1 2", "expected an operator or the end"),
    ("", "empty expression"),
    ("1" * 41, "has 41 digits"),
    ("9" * 40 + " * " + "9" * 40, "more than 60 digits"),
    ("(" * 40 + "1" + ")" * 40, "nesting deeper than 32"),
    ("-" * 40 + "1", "nesting deeper than 32"),
    ("1 + " * 100 + "1", "allowed at most 256"),
])
def test_rejects_everything_outside_the_grammar(expr, fragment):
  with pytest.raises(CalcError, match=re.escape(fragment)):
    evaluate(expr)
  assert calculate(expr).startswith("error: ")  # the tool never raises


def test_division_by_zero_is_an_error_text():
  assert calculate("5 // (3 - 3)") == "error: division by zero"
  assert calculate("5 % 0") == "error: division by zero"
  assert calculate("12 // 5") == "2"


def test_the_tool_is_registered():
  from hybridmoe_jax.rl.envs import get_tool
  assert get_tool("calculator") is calculator.CALCULATOR
  assert calculator.CALCULATOR.call("6 * 7") == "42"
