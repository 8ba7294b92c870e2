"""Multi-hop key-value pointer chasing over a long document, with a `lookup` tool.

The document has one `key: value` line per key; keys are 6 lowercase letters, a value is
another key or a 6-digit number. The task starts at one key; following values from it
reaches a number after exactly `hops` lookups, and that number is the answer (exact match).
Distractor chains of random length fill the rest of the document, so only the chain from
the start key leads to the answer.

horizon(level) = hops = level + 1 (the oracle looks up every key of the chain);
document lines = base_lines * (level + 1), at least hops + 1. The document is part of the
prompt by default (show_document=True): a long-context reader can answer from it; the
`lookup` tool returns one key's value.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from hybridmoe_jax.data.retrieval import distinct
from hybridmoe_jax.rl.envs.base import Answer, Environment, Tool, ToolCall, register_env

_LETTERS = np.array(list(string.ascii_lowercase))


@dataclasses.dataclass(frozen=True)
class RetrievalTask:
  table: dict                      # key -> value, in document order
  chain: tuple[str, ...]           # the start key and the keys it leads to (hops keys)
  answer: str

  @property
  def document(self) -> str:
    return "\n".join(f"{k}: {v}" for k, v in self.table.items())


class RetrievalEnv(Environment):
  """Pointer chasing: `lookup(key)` -> value; hops and document length grow with level."""

  name = "retrieval"
  max_level = 63

  def __init__(self, *, base_lines: int = 16, show_document: bool = True, **kwargs):
    """Args:
      base_lines: document lines per level step (lines = base_lines * (level + 1)), 1..4096.
      show_document: put the document in the prompt (else only the tool reveals it).
      **kwargs: Environment's (extra_turns, extra_tools).
    """
    super().__init__(**kwargs)
    if isinstance(base_lines, bool) or not isinstance(base_lines, int) or \
        not 1 <= base_lines <= 4096:
      raise ValueError(f"retrieval: base_lines = {base_lines!r}: allowed an int in [1, 4096]")
    self.base_lines = base_lines
    self.show_document = bool(show_document)

  def horizon(self, level: int) -> int:
    return self.check_level(level) + 1

  def num_lines(self, level: int) -> int:
    return max(self.base_lines * (self.check_level(level) + 1), self.horizon(level) + 1)

  def _make_task(self, rng, level):
    hops, n = self.horizon(level), self.num_lines(level)
    # unique random keys (26**6 of them: collisions are rare)
    keys = distinct(lambda: "".join(rng.choice(_LETTERS, 6)), n)
    numbers = iter(rng.choice(900_000, size=n, replace=False) + 100_000)
    table = {}
    # The answer chain: hops keys, each pointing to the next, the last to a number.
    chain = keys[:hops]
    for a, b in zip(chain, chain[1:]):
      table[a] = b
    answer = str(next(numbers))
    table[chain[-1]] = answer
    # Distractor chains over the remaining keys, each ending in its own number.
    rest, i = keys[hops:], 0
    while i < len(rest):
      length = int(rng.integers(1, hops + 2))
      part = rest[i:i + length]
      for a, b in zip(part, part[1:]):
        table[a] = b
      table[part[-1]] = str(next(numbers))
      i += length
    order = rng.permutation(len(table))
    items = list(table.items())
    return RetrievalTask({items[j][0]: items[j][1] for j in order}, tuple(chain), answer)

  def _prompt(self, task):
    text = (f"Start at key '{task.chain[0]}'. Look up its value; while the value is a key, "
            "look that key up. Answer with the number you reach.")
    if self.show_document:
      text += f"\n<document>\n{task.document}\n</document>"
    return text

  def _tools(self, task):
    def lookup(argument: str) -> str:
      key = argument.strip().strip("'\"")
      if key not in task.table:
        return f"error: no key {key!r} in the document"
      return task.table[key]
    return [Tool("lookup", "returns the value of one key of the document, e.g. `abcdef`.",
                 lookup)]

  def _score(self, task, answer):
    return float(answer.strip() == task.answer), {"target": task.answer}

  def _oracle(self, task):
    return [ToolCall("lookup", key) for key in task.chain] + [Answer(task.answer)]


register_env("retrieval", RetrievalEnv)
