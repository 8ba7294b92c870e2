"""A safe integer calculator: its own tokenizer and recursive-descent parser, never `eval`.

Grammar (whitespace between tokens is ignored):
    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "//" | "%") unary)*
    unary  := ("+" | "-") unary | atom
    atom   := INTEGER | "(" expr ")"
INTEGER is decimal digits only. `//` and `%` are Python's floor division and modulo (the
remainder takes the divisor's sign). Nothing else is in the grammar: no names, calls,
attributes, strings, `**`, `/`, floats. Sizes are bounded so no input can take long:
at most MAX_CHARS characters, MAX_DIGITS digits per literal, nesting depth MAX_DEPTH, and
every intermediate value within +-10**MAX_RESULT_DIGITS.
"""

from __future__ import annotations

import re

from hybridmoe_jax.rl.envs.base import Tool, register_tool

MAX_CHARS = 256
MAX_DIGITS = 40
MAX_DEPTH = 32
MAX_RESULT_DIGITS = 60
_LIMIT = 10**MAX_RESULT_DIGITS
_TOKEN = re.compile(r"\s*(?:(\d+)|(//|[-+*%()]))")
_ALLOWED = "integers, + - * // % and parentheses"


class CalcError(ValueError):
  """An expression outside the grammar or its bounds; the message is one line."""


def _tokenize(text: str) -> list[tuple[str, int, int | str]]:
  """(kind, position, value) with kind "int" or "op", then ("end", len, "")."""
  out, pos = [], 0
  while pos < len(text):
    if text[pos:].strip() == "":
      break
    m = _TOKEN.match(text, pos)
    if m is None:
      start = len(text) - len(text[pos:].lstrip())
      ch = text[start]
      hint = ("'/' is true division: use // for integer division" if ch == "/"
              else f"unexpected character {ch!r} at position {start}")
      raise CalcError(f"{hint}; allowed: {_ALLOWED}")
    if m.group(1) is not None:
      if len(m.group(1)) > MAX_DIGITS:
        raise CalcError(f"integer at position {m.start(1)} has {len(m.group(1))} digits; "
                        f"allowed at most {MAX_DIGITS}")
      out.append(("int", m.start(1), int(m.group(1))))
    else:
      if m.group(2) == "*" and text.startswith("**", m.start(2)):
        raise CalcError(f"'**' (power) at position {m.start(2)} is not allowed; "
                        f"allowed: {_ALLOWED}")
      out.append(("op", m.start(2), m.group(2)))
    pos = m.end()
  out.append(("end", len(text), ""))
  return out


class _Parser:
  """Recursive descent over the token list; evaluates as it parses."""

  def __init__(self, tokens):
    self.tokens, self.i, self.depth = tokens, 0, 0

  def peek(self):
    return self.tokens[self.i]

  def take(self):
    tok = self.tokens[self.i]
    self.i += 1
    return tok

  def fail(self, what: str):
    kind, pos, value = self.peek()
    got = "end of input" if kind == "end" else repr(str(value))
    raise CalcError(f"expected {what} at position {pos}, got {got}; allowed: {_ALLOWED}")

  def expr(self) -> int:
    value = self.term()
    while self.peek()[0] == "op" and self.peek()[2] in "+-":
      op = self.take()[2]
      value = _bounded(value + self.term() if op == "+" else value - self.term())
    return value

  def term(self) -> int:
    value = self.unary()
    while self.peek()[0] == "op" and self.peek()[2] in ("*", "//", "%"):
      op = self.take()[2]
      rhs = self.unary()
      if op == "*":
        value = _bounded(value * rhs)
      elif rhs == 0:
        raise CalcError("division by zero")
      else:
        value = value // rhs if op == "//" else value % rhs
    return value

  def unary(self) -> int:
    if self.peek()[0] == "op" and self.peek()[2] in "+-":
      op = self.take()[2]
      value = self.nested(self.unary)
      return -value if op == "-" else value
    return self.atom()

  def atom(self) -> int:
    kind, _, value = self.peek()
    if kind == "int":
      self.take()
      return value
    if kind == "op" and value == "(":
      self.take()
      inner = self.nested(self.expr)
      if self.peek()[2] != ")" or self.peek()[0] != "op":
        self.fail("')'")
      self.take()
      return inner
    self.fail("an integer or '('")

  def nested(self, parse) -> int:
    """parse() one level deeper; the depth bound keeps the recursion short."""
    self.depth += 1
    if self.depth > MAX_DEPTH:
      raise CalcError(f"nesting deeper than {MAX_DEPTH}; allowed at most {MAX_DEPTH}")
    try:
      return parse()
    finally:
      self.depth -= 1


def _bounded(value: int) -> int:
  if not -_LIMIT < value < _LIMIT:
    raise CalcError(f"a value has more than {MAX_RESULT_DIGITS} digits")
  return value


def evaluate(text: str) -> int:
  """The integer value of `text` under the grammar above.

  Raises:
    CalcError: empty or too long input, a token outside the grammar, a syntax error,
      division or modulo by zero, or a value out of bounds (one line saying which).
  """
  if not isinstance(text, str):
    raise CalcError(f"expression must be a str, got {type(text).__name__}")
  if len(text) > MAX_CHARS:
    raise CalcError(f"expression has {len(text)} characters; allowed at most {MAX_CHARS}")
  if not text.strip():
    raise CalcError(f"empty expression; allowed: {_ALLOWED}")
  parser = _Parser(_tokenize(text))
  value = parser.expr()
  if parser.peek()[0] != "end":
    parser.fail("an operator or the end")
  return value


def calculate(text: str) -> str:
  """The calculator tool: the value as decimal text, or "error: ..." (never raises for
  bad input)."""
  try:
    return str(evaluate(text))
  except CalcError as e:
    return f"error: {e}"


CALCULATOR = Tool(
    "calculator",
    "evaluates one integer expression: integers, + - * // (floor division) % and "
    "parentheses, e.g. `(12 + 7) * 3 // 2`; returns the integer.",
    calculate)
register_tool(CALCULATOR)
