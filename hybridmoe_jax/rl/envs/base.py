"""The environment protocol for multi-turn tool use, the Tool type, and the registries.

An episode: `obs = env.reset(seed, level)` gives the task prompt and the tool specs; each
assistant turn becomes one action and `env.step(action)` answers it:
  ToolCall(name, argument)  -> the tool's result text; the episode goes on
  Answer(text)              -> the exact checker's reward in [0, 1]; the episode ends
  Malformed(error)          -> a turn the chat parser could not read: an error text, the turn
                               counts, the episode goes on
After `max_turns` turns without an answer the episode ends with reward 0 ("max_turns").
Nothing a tool or the environment does raises out of `step`: a crashing tool ends the
episode with reward 0 and finish_reason "tool_error", a crash of the environment itself
(its checker, its bookkeeping) with "env_error"; the message is in `info["error"]`.
Calling `step` before `reset` or after the episode ended is a caller bug (RuntimeError).

Every environment has a difficulty `level` (int in [0, max_level]) and a `horizon(level)`:
the number of tool calls its oracle needs, growing with the level. `oracle()` returns the
actions that solve the current episode with reward 1. Episodes are deterministic given
(seed, level). Subclasses implement five small hooks (`_make_task`, `_prompt`, `_tools`,
`_score`, `_oracle`) and `horizon`; see arithmetic.py for the smallest one.

Users add environments with `register_env(name, factory)` and stateless tools with
`register_tool(tool)`; `make_env(name, extra_tools=("my_tool",))` builds an environment
with registered tools added to every episode.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Sequence, Union

import numpy as np

from hybridmoe_jax.config import is_int

FINISH_REASONS = ("answer", "max_turns", "tool_error", "env_error", "timeout")
# Tool results longer than this are cut (with a note): one runaway tool output must not
# blow up the context of every later turn.
MAX_TOOL_CHARS = 4000
_MAX_SEED = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """Call tool `name` with one argument string (its grammar is the tool's own)."""
  name: str
  argument: str = ""


@dataclasses.dataclass(frozen=True)
class Answer:
  """The final answer; the environment's exact checker scores `text`."""
  text: str


@dataclasses.dataclass(frozen=True)
class Malformed:
  """An assistant turn that could not be parsed into an action; `error` says why."""
  error: str


Action = Union[ToolCall, Answer, Malformed]


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  """What the model is told about a tool."""
  name: str
  description: str


@dataclasses.dataclass(frozen=True)
class Tool:
  """A named function of one string argument returning a string.

  Attributes:
    name: an identifier ([A-Za-z_][A-Za-z0-9_]*): the chat format parses it up to the first
      space.
    description: one or two lines for the system prompt (what the argument is).
    fn: argument -> result text. Expected failures (bad input) should come back as an
      "error: ..." text; an exception is treated as a crashed tool (ends the episode).
  """
  name: str
  description: str
  fn: Callable[[str], str]

  def __post_init__(self):
    if not (isinstance(self.name, str) and self.name.isidentifier()):
      raise ValueError(f"Tool.name = {self.name!r}: allowed an identifier "
                       "([A-Za-z_][A-Za-z0-9_]*)")

  def call(self, argument: str) -> str:
    return self.fn(argument)

  @property
  def spec(self) -> ToolSpec:
    return ToolSpec(self.name, self.description)


@dataclasses.dataclass(frozen=True)
class Observation:
  """What an episode starts from.

  Attributes:
    prompt: the task text (the user turn).
    tools: the tools this episode offers.
    level, seed: the episode's difficulty and seed.
    horizon: tool calls the oracle needs.
    max_turns: turns (tool calls, malformed turns and the answer) before the episode is cut.
    brief: the short form of the prompts (a small model's RL preset: fewer tokens per
      episode); the chat format then lists the tools by name only.
  """
  prompt: str
  tools: tuple[ToolSpec, ...]
  level: int
  seed: int
  horizon: int
  max_turns: int
  brief: bool = False


@dataclasses.dataclass(frozen=True)
class StepResult:
  """The environment's answer to one action.

  Attributes:
    text: the tool result (or error text) to show the model; "" after an answer.
    done: the episode has ended.
    reward: float in [0, 1]; 0 until the episode ends.
    finish_reason: one of FINISH_REASONS when done, else None.
    info: turn number, tool name, error message, checker details.
  """
  text: str
  done: bool
  reward: float = 0.0
  finish_reason: str | None = None
  info: dict = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
  """Base of the multi-turn environments: turn counting, tool dispatch, error containment.

  Subclasses set `name` and `max_level` and implement the hooks below. The task state is
  whatever `_make_task` returns (a small dataclass); the hooks receive it.
  """

  name: ClassVar[str] = ""
  max_level: ClassVar[int] = 32

  def __init__(self, *, extra_turns: int = 2, extra_tools: Sequence[Union[str, Tool]] = (),
               brief: bool = False):
    """Args:
      extra_turns: turns allowed beyond the oracle's (horizon tool calls + 1 answer); >= 0.
      extra_tools: registered tool names or Tool objects added to every episode.
      brief: short prompts (`_prompt` may read `self.brief`; the system turn names the
        tools only). Same tasks, checkers and oracle.
    """
    if not isinstance(extra_turns, int) or extra_turns < 0:
      raise ValueError(f"extra_turns = {extra_turns!r}: allowed an int >= 0")
    if not isinstance(brief, bool):
      raise ValueError(f"brief = {brief!r}: allowed True or False")
    self.brief = brief
    self.extra_turns = extra_turns
    self._extra_tools = tuple(get_tool(t) if isinstance(t, str) else t for t in extra_tools)
    self._task = None
    self._tool_table: dict[str, Tool] = {}
    self._turn = 0
    self._done = True
    self._obs: Observation | None = None

  # ---- hooks -------------------------------------------------------------------------

  @abc.abstractmethod
  def horizon(self, level: int) -> int:
    """Tool calls the oracle needs at `level` (non-decreasing in level)."""

  @abc.abstractmethod
  def _make_task(self, rng: np.random.Generator, level: int) -> Any:
    """The episode's hidden task state, drawn from `rng` only (determinism)."""

  @abc.abstractmethod
  def _prompt(self, task) -> str:
    """The user-turn text."""

  @abc.abstractmethod
  def _tools(self, task) -> list[Tool]:
    """The tools of this episode (may close over the task, e.g. its document)."""

  @abc.abstractmethod
  def _score(self, task, answer: str) -> tuple[float, dict]:
    """The exact checker: (reward in [0, 1], info). info may set "finish_reason" to
    "timeout" (e.g. the sandbox ran out of time)."""

  @abc.abstractmethod
  def _oracle(self, task) -> list[Action]:
    """`horizon` tool calls then the Answer that scores 1."""

  # ---- protocol ----------------------------------------------------------------------

  def max_turns(self, level: int) -> int:
    return self.horizon(level) + 1 + self.extra_turns

  def check_level(self, level) -> int:
    if not (is_int(level) and 0 <= level <= self.max_level):
      raise ValueError(f"{self.name}: level = {level!r}: allowed an int in "
                       f"[0, {self.max_level}]")
    return int(level)

  def reset(self, seed: int, level: int) -> Observation:
    """Starts an episode; deterministic given (seed, level).

    Raises:
      ValueError: seed not an int in [0, 2**63), or level outside [0, max_level].
    """
    if not (is_int(seed) and 0 <= seed <= _MAX_SEED):
      raise ValueError(f"{self.name}: seed = {seed!r}: allowed an int in [0, 2**63)")
    level = self.check_level(level)
    # The env name is part of the stream so two environments with one seed differ.
    rng = np.random.default_rng([int(seed), level, *self.name.encode()])
    self._task = self._make_task(rng, level)
    tools = list(self._tools(self._task)) + list(self._extra_tools)
    self._tool_table = {}
    for tool in tools:
      if tool.name in self._tool_table:
        raise ValueError(f"{self.name}: two tools named {tool.name!r}")
      self._tool_table[tool.name] = tool
    self._turn, self._done = 0, False
    self._obs = Observation(prompt=self._prompt(self._task),
                            tools=tuple(t.spec for t in self._tool_table.values()), level=level,
                            seed=int(seed), horizon=self.horizon(level),
                            max_turns=self.max_turns(level), brief=self.brief)
    return self._obs

  @property
  def observation(self) -> Observation | None:
    return self._obs

  def oracle(self) -> list[Action]:
    """The actions that solve the current episode (reward 1)."""
    if self._task is None:
      raise RuntimeError(f"{self.name}: oracle() before reset()")
    return list(self._oracle(self._task))

  def step(self, action: Action) -> StepResult:
    """Answers one action; never raises for a crashing tool or environment.

    Raises:
      RuntimeError: no episode is running (before reset, or after it ended).
      TypeError: `action` is not a ToolCall, Answer or Malformed.
    """
    if self._done:
      raise RuntimeError(f"{self.name}: step() without a running episode; call reset()")
    if not isinstance(action, (ToolCall, Answer, Malformed)):
      raise TypeError(f"{self.name}: action {action!r}: allowed ToolCall, Answer, Malformed")
    self._turn += 1
    info: dict = {"turn": self._turn}
    try:
      result = self._dispatch(action, info)
    except Exception as e:  # pylint: disable=broad-except
      # The environment's own code failed: record it on the trajectory, never raise.
      info["error"] = f"{type(e).__name__}: {e}"
      result = StepResult("", True, 0.0, "env_error", info)
    if not result.done and self._turn >= self._obs.max_turns:
      result = StepResult(result.text, True, 0.0, "max_turns", info)
    self._done = result.done
    return result

  def _dispatch(self, action: Action, info: dict) -> StepResult:
    if isinstance(action, Answer):
      reward, details = self._score(self._task, action.text)
      info.update(details)
      reward = float(reward)
      if not 0.0 <= reward <= 1.0:
        raise ValueError(f"checker returned reward {reward}, allowed [0, 1]")
      return StepResult("", True, reward, info.pop("finish_reason", "answer"), info)
    if isinstance(action, Malformed):
      info["malformed"] = True
      return StepResult(f"error: {action.error}", False, 0.0, None, info)
    info["tool"] = action.name
    tool = self._tool_table.get(action.name)
    if tool is None:
      names = ", ".join(self._tool_table) or "none"
      return StepResult(f"error: unknown tool {action.name!r}; tools: {names}", False, 0.0,
                        None, info)
    try:
      text = tool.call(action.argument)
      if not isinstance(text, str):
        raise TypeError(f"tool {tool.name!r} returned {type(text).__name__}, not str")
    except Exception as e:  # pylint: disable=broad-except
      info["error"] = f"{type(e).__name__}: {e}"
      return StepResult(f"error: tool {tool.name!r} failed", True, 0.0, "tool_error", info)
    if len(text) > MAX_TOOL_CHARS:
      text = text[:MAX_TOOL_CHARS] + f"\n[cut: {len(text)} chars]"
    return StepResult(text, False, 0.0, None, info)


# ---- registries ------------------------------------------------------------------------

_ENVS: dict[str, Callable[..., Environment]] = {}
_TOOLS: dict[str, Tool] = {}


def register_env(name: str, factory: Callable[..., Environment], *,
                 overwrite: bool = False) -> None:
  """Makes `make_env(name, **kwargs)` call `factory(**kwargs)`."""
  if not (isinstance(name, str) and name):
    raise ValueError(f"env name = {name!r}: allowed a non-empty str")
  if name in _ENVS and not overwrite and _ENVS[name] is not factory:
    raise ValueError(f"env {name!r} is already registered (pass overwrite=True)")
  _ENVS[name] = factory


def env_names() -> tuple[str, ...]:
  return tuple(sorted(_ENVS))


def make_env(name: str, **kwargs) -> Environment:
  """A new environment from the registry.

  Raises:
    ValueError: no environment is registered under `name` (the known names are listed).
  """
  if name not in _ENVS:
    raise ValueError(f"env = {name!r}: allowed one of {list(env_names())}")
  return _ENVS[name](**kwargs)


def register_tool(tool: Tool, *, overwrite: bool = False) -> None:
  """Registers a stateless tool under its name (for `extra_tools`)."""
  if not isinstance(tool, Tool):
    raise TypeError(f"register_tool: {tool!r} is not a Tool")
  if tool.name in _TOOLS and not overwrite and _TOOLS[tool.name] is not tool:
    raise ValueError(f"tool {tool.name!r} is already registered (pass overwrite=True)")
  _TOOLS[tool.name] = tool


def tool_names() -> tuple[str, ...]:
  return tuple(sorted(_TOOLS))


def get_tool(name: str) -> Tool:
  if name not in _TOOLS:
    raise ValueError(f"tool = {name!r}: allowed one of {list(tool_names())}")
  return _TOOLS[name]
