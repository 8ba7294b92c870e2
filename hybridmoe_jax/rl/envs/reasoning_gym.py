"""Single-turn tasks from reasoning-gym: one procedurally generated item per episode.

Optional: needs the `reasoning-gym` extra (`pip install -e ".[reasoning-gym]"`); this module
imports without it, and building the environment without it raises MissingExtraError (an
ImportError, and a ValueError so config checks report it as one line).

An episode is one item of the dataset named by the constructor (default "basic_arithmetic"),
drawn deterministically from (seed, level): a 32-bit item seed from the base class's
per-episode generator (some datasets call np.random.seed), then
`create_dataset(name, **level_config, seed=item_seed, size=1)[0]`, a dict {question, answer,
metadata}. The prompt is the question verbatim (also in brief mode); no tools (horizon 0,
the model answers in its first turn; `extra_turns` defaults to 0, so a turn that does not
parse as an answer ends the episode with reward 0); the checker is the dataset's own
`score_answer(answer.strip(), item)` in [0, 1] (it may give partial credit: basic_arithmetic
gives len(target) / len(answer) when the target is inside); the oracle answers item["answer"].

Levels come from the dataset's reasoning-gym curriculum when it has one: level L sets every
curriculum attribute to its level min(L, its last level), read as reasoning-gym's default
("inclusive") context does: a range from the easiest value up to the level-L value, so each
level adds harder items. max_level = the longest attribute's level count - 1, lowered to
the last level before one whose config the dataset rejects. "basic_arithmetic" has 5:
  level      0     1     2     3     4
  terms      2     2-3   2-4   2-5   2-6
  digits     1     1-2   1-3   1-4   1-4
(level 4 is reasoning-gym's own default config). A dataset without a curriculum has level 0
only. A few datasets generate no reference answer (no oracle, so no SFT demos: boxnet,
graph_color, propositional_logic, rubiks_cube, rush_hour in 0.1.25) and some levels of a few
take over 4 s per item (jugs, sokoban, zebra_puzzles).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Sequence, Union

from hybridmoe_jax.rl.envs.base import Answer, Environment, Tool, register_env

EXTRA = 'pip install -e ".[reasoning-gym]"'
DEFAULT_DATASET = "basic_arithmetic"
# Item seeds are drawn below this: np.random.seed (used by some datasets) takes 32 bits.
_ITEM_SEEDS = 2**32
# The target as recorded in the step info (trajectory logs) is cut to this many chars.
_INFO_CHARS = 200


class MissingExtraError(ImportError, ValueError):
  """reasoning-gym is not installed (the `reasoning-gym` extra)."""


def _reasoning_gym():
  """The reasoning_gym package; MissingExtraError naming the extra when it is absent."""
  try:
    return importlib.import_module("reasoning_gym")
  except ImportError:
    raise MissingExtraError("the reasoning_gym environment needs the reasoning-gym package, "
                            f"which is not installed: {EXTRA}") from None


def level_configs(dataset: str) -> list[dict[str, Any]]:
  """Config fields (minus seed and size) of `dataset` at levels 0 .. max_level.

  From the dataset's curriculum (every attribute at min(level, its last level), ranges from
  its first value, as reasoning-gym's default context reads them), up to the last level
  whose config the dataset's own `validate` accepts; [{}] (level 0 = the default config)
  for a dataset without a curriculum.

  Raises:
    MissingExtraError: reasoning-gym is not installed.
    ValueError: `dataset` is not a registered reasoning-gym dataset.
  """
  rg = _reasoning_gym()
  names = sorted(rg.factory.DATASETS)
  if dataset not in names:
    raise ValueError(f"reasoning_gym: dataset = {dataset!r}: allowed a reasoning-gym dataset "
                     f"({len(names)}), e.g. {', '.join(names[:6])}, ...")
  if not rg.factory.has_curriculum(dataset):
    return [{}]
  curriculum = rg.factory.create_curriculum(dataset)
  levels = max((len(a.levels) for a in curriculum.attributes.values()), default=1)
  out = []
  for level in range(levels):
    curriculum.set_global_level(level)
    config = curriculum.generate_configuration()
    try:
      if hasattr(config, "validate"):
        config.validate()
    except (AssertionError, ValueError, TypeError):
      # Upstream curricula whose later levels break their own config checks: stop there.
      break
    out.append({f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                if f.name not in ("seed", "size")})
  return out or [{}]


@dataclasses.dataclass(frozen=True)
class ReasoningGymTask:
  """One item. `data` is the one-item dataset: its score_answer may read its config."""
  item_seed: int
  item: dict
  data: Any


class ReasoningGymEnv(Environment):
  """One reasoning-gym item per episode, answered in one turn; see the module docstring.

  `max_level` is per instance (it depends on `dataset`).
  """

  name = "reasoning_gym"
  max_level = 0

  def __init__(self, dataset: str = DEFAULT_DATASET, *, extra_turns: int = 0,
               extra_tools: Sequence[Union[str, Tool]] = (), brief: bool = False):
    """Args:
      dataset: a reasoning-gym dataset name (reasoning_gym.factory.DATASETS).
      extra_turns: turns allowed beyond the one answer (e.g. to retry a malformed turn).
      extra_tools, brief: as Environment (brief prompts are the question itself anyway).

    Raises:
      MissingExtraError: reasoning-gym is not installed.
      ValueError: an unknown dataset or a bad base argument.
    """
    super().__init__(extra_turns=extra_turns, extra_tools=extra_tools, brief=brief)
    if not isinstance(dataset, str):
      raise ValueError(f"reasoning_gym: dataset = {dataset!r}: allowed a dataset name (str)")
    self._levels = level_configs(dataset)
    self.dataset = dataset
    self.max_level = len(self._levels) - 1

  def horizon(self, level: int) -> int:
    self.check_level(level)
    return 0

  def _make_task(self, rng, level):
    item_seed = int(rng.integers(_ITEM_SEEDS))
    data = _reasoning_gym().create_dataset(self.dataset, **self._levels[level],
                                           seed=item_seed, size=1)
    item = data[0]
    if not isinstance(item.get("question"), str):
      raise ValueError(f"reasoning_gym: dataset {self.dataset!r} gave an item without a "
                       "question string")
    return ReasoningGymTask(item_seed, item, data)

  def _prompt(self, task):
    return task.item["question"]

  def _tools(self, task):
    return []

  def _score(self, task, answer):
    reward = task.data.score_answer(answer.strip(), task.item)
    target = task.item.get("answer")
    return float(reward), {"target": None if target is None else str(target)[:_INFO_CHARS]}

  def _oracle(self, task):
    if task.item.get("answer") is None:
      raise RuntimeError(f"reasoning_gym: dataset {self.dataset!r} items carry no reference "
                         "answer (its checker accepts several): no oracle")
    return [Answer(str(task.item["answer"]))]


register_env("reasoning_gym", ReasoningGymEnv)
