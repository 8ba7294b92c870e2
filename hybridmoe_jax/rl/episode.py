"""What a rollout takes and gives: EpisodeSpec in, Trajectory (finished) or PendingEpisode
(paused over its token budget) out.

Conventions: n the tokens of an episode so far (prompt, assistant turns, tool results, in
order). Per-token arrays are aligned with `ids`:
    ids          int32 [n]    token ids, generated ones exactly as sampled (never re-encoded)
    loss_mask    int32 [n]    1 on assistant-generated tokens (each turn's body and its
                              <end_turn>, sampled or forced), 0 on prompt / headers / tools
    forced       int32 [n]    1 where a forced script supplied the assistant token
    logp         float32 [n]  log-softmax of the model's RAW logits (temperature 1, no
                              filter) at the token; 0 where loss_mask is 0 (a diagnostic:
                              the trajectory log's mean_logp)
    sample_logp  float32 [n]  the token under the distribution the rollout drew from
                              (infer.sampling.sampling_logits: vocab-limited, temperature-
                              scaled, top-k / top-p filtered, renormalised; greedy: 0 for the
                              argmax, -1e30 otherwise): the behaviour policy, the learner's
                              lp_old (rl/learner.py sampling_logps computes the same
                              transform). Equal to logp at temperature 1 without filters; a
                              forced token outside the filtered set gets about -1e30.
    turn_index   int32 [n]    the message each token belongs to (chat_format.render's
                              convention: -1 bos, i for messages[i] and its header)
So `chat_format.render(tokenizer, trajectory.messages)` reproduces ids, loss_mask (its
assistant mask) and turn_index exactly.

PendingEpisode keeps a paused episode: its token arrays, the batch-1 DecodeCache row
holding ids[:n_cached] (`ids[n_cached:]` is fed first on resume), the actions already sent
to the environment, and counters; `to_tree()` / `from_tree()` turn it into checkpointable
arrays + plain python and back. Without its live environment object a resumed episode
rebuilds the environment by `reset(seed, level)` and replaying the recorded actions
(environments are deterministic), checking that every tool result comes back identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hybridmoe_jax.config import is_int
from hybridmoe_jax.model.cache import DecodeCache
from hybridmoe_jax.rl.chat_format import Message
from hybridmoe_jax.rl.envs.base import (Action, Answer, Environment, Malformed, ToolCall,
                                        env_names, make_env)

TOKEN_FIELDS = ("ids", "loss_mask", "forced", "logp", "sample_logp", "turn_index")
_TOKEN_DTYPES = {"logp": np.float32, "sample_logp": np.float32}
_MAX_SAMPLE_SEED = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
  """One episode to roll out.

  Attributes:
    env: a registered environment name (envs.env_names()).
    seed: the environment seed (the task); int in [0, 2**63).
    level: the difficulty, in [0, env.max_level].
    group: group id (episodes of one task sampled several times share it: GRPO groups).
    sample_seed: int in [0, 2**32): with the token position it fixes the sampling key of
      every token (fold_in(PRNGKey(sample_seed), position)), so an episode's tokens do not
      depend on its batch neighbours or on being paused and resumed.
    forced: per assistant turn i < len(forced): a ToolCall / Answer (rendered by the chat
      format) or a tuple of token ids whose tokens replace the sampled ones (teacher
      forcing; their log-probs are still recorded under the model), or None to sample that
      turn. Turns past the script are sampled.
    env_kwargs: keyword arguments of make_env, as (name, value) pairs (hashable).
  """
  env: str
  seed: int
  level: int
  group: int = 0
  sample_seed: int = 0
  forced: tuple = ()
  env_kwargs: tuple = ()

  def check(self, where: str = "episode") -> None:
    """Raises ValueError naming the field and the allowed range (before any compute)."""
    if self.env not in env_names():
      raise ValueError(f"{where}.env = {self.env!r}: allowed one of {list(env_names())}")
    for name, v, hi in (("seed", self.seed, 2**63 - 1), ("sample_seed", self.sample_seed,
                                                         _MAX_SAMPLE_SEED),
                        ("group", self.group, 2**63 - 1)):
      if not is_int(v) or not 0 <= v <= hi:
        raise ValueError(f"{where}.{name} = {v!r}: allowed an int in [0, {hi}]")
    if not isinstance(self.forced, tuple):
      raise ValueError(f"{where}.forced: allowed a tuple (one entry per turn), got "
                       f"{type(self.forced).__name__}")
    for i, f in enumerate(self.forced):
      ok = f is None or isinstance(f, (ToolCall, Answer)) or (
          isinstance(f, tuple) and len(f) > 0 and
          all(isinstance(t, (int, np.integer)) for t in f))
      if not ok:
        raise ValueError(f"{where}.forced[{i}] = {f!r}: allowed None, a ToolCall, an Answer "
                         "or a non-empty tuple of token ids")
    if not (isinstance(self.env_kwargs, tuple) and
            all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                for p in self.env_kwargs)):
      raise ValueError(f"{where}.env_kwargs = {self.env_kwargs!r}: allowed a tuple of "
                       "(name, value) pairs")

  def make_env(self) -> Environment:
    return make_env(self.env, **dict(self.env_kwargs))


def oracle_script(spec: EpisodeSpec) -> tuple:
  """The oracle actions of the spec's episode (for `forced`)."""
  env = spec.make_env()
  env.reset(spec.seed, spec.level)
  return tuple(env.oracle())


@dataclasses.dataclass
class Trajectory:
  """A finished episode (see the module docstring for the per-token arrays).

  Attributes:
    spec: the episode.
    ids, loss_mask, forced, logp, sample_logp, turn_index: per token, length n.
    messages: the conversation (assistant turns carry their sampled ids).
    reward: in [0, 1]; 0 unless the environment ended the episode with a score.
    finish_reason: the environment's (answer, max_turns, tool_error, env_error, timeout)
      or the rollout's (max_tokens: the episode's token cap; max_turns: the rollout's cap).
    num_turns: assistant turns (complete or cut).
    prompt_len: tokens before the first assistant token.
    info: the last environment step's info (turn, tool, error, checker details).
  """
  spec: EpisodeSpec
  ids: np.ndarray
  loss_mask: np.ndarray
  forced: np.ndarray
  logp: np.ndarray
  sample_logp: np.ndarray
  turn_index: np.ndarray
  messages: tuple
  reward: float
  finish_reason: str
  num_turns: int
  prompt_len: int
  info: dict

  @property
  def env_name(self) -> str:
    return self.spec.env

  @property
  def level(self) -> int:
    return self.spec.level

  @property
  def group(self) -> int:
    return self.spec.group

  @property
  def generated(self) -> int:
    return int(self.loss_mask.sum())

  def to_tree(self) -> dict:
    """Arrays and plain python, for a checkpoint (the spec and messages as tuples)."""
    tree = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {**tree, "spec": _spec_tree(self.spec),
            "messages": tuple(_message_tree(m) for m in self.messages)}

  @classmethod
  def from_tree(cls, tree: dict) -> "Trajectory":
    """Inverse of to_tree."""
    return cls(**{**tree, "spec": _spec_from_tree(tree["spec"]),
                  "messages": tuple(_message_from_tree(m) for m in tree["messages"])})


@dataclasses.dataclass
class PendingEpisode:
  """A paused episode (see the module docstring).

  Attributes:
    spec: the episode.
    tokens: {field: array [n]} for every TOKEN_FIELDS field.
    n_cached: ids[:n_cached] are in `cache`; ids[n_cached:] are fed first on resume.
    cache: the episode's DecodeCache row (batch 1).
    actions: the actions sent to the environment so far, in order.
    messages: the conversation so far (a cut last assistant turn is not in it yet).
    turn_tokens: tokens generated in the current, unfinished assistant turn.
    num_turns: assistant turns finished.
    prompt_len: tokens before the first assistant token.
    env: the live environment (not saved by to_tree; rebuilt by replay when absent).
  """
  spec: EpisodeSpec
  tokens: dict
  n_cached: int
  cache: DecodeCache
  actions: tuple
  messages: tuple
  turn_tokens: int
  num_turns: int
  prompt_len: int
  env: Environment | None = dataclasses.field(default=None, compare=False, repr=False)

  def to_tree(self) -> dict:
    """Arrays (the token arrays, the cache row) and plain python, for a checkpoint."""
    return {"spec": _spec_tree(self.spec), "tokens": {k: np.asarray(v) for k, v in
                                                      self.tokens.items()},
            "n_cached": int(self.n_cached), "cache": self.cache,
            "actions": tuple(_action_tree(a) for a in self.actions),
            "messages": tuple(_message_tree(m) for m in self.messages),
            "turn_tokens": int(self.turn_tokens), "num_turns": int(self.num_turns),
            "prompt_len": int(self.prompt_len)}

  @classmethod
  def from_tree(cls, tree: dict) -> "PendingEpisode":
    """Inverse of to_tree (without a live environment: resuming replays the actions)."""
    missing = {"spec", "tokens", "n_cached", "cache", "actions", "messages", "turn_tokens",
               "num_turns", "prompt_len"} - set(tree)
    if missing:
      raise ValueError(f"pending episode tree lacks {sorted(missing)}")
    tokens = {k: np.asarray(tree["tokens"][k], _TOKEN_DTYPES.get(k, np.int32))
              for k in TOKEN_FIELDS}
    return cls(_spec_from_tree(tree["spec"]), tokens, int(tree["n_cached"]), tree["cache"],
               tuple(_action_from_tree(a) for a in tree["actions"]),
               tuple(_message_from_tree(m) for m in tree["messages"]),
               int(tree["turn_tokens"]), int(tree["num_turns"]), int(tree["prompt_len"]))


# ---- plain-python forms (tuples of str / int) of specs, actions and messages ----------------

def _action_tree(a: Action | None) -> tuple | None:
  if a is None:
    return None
  if isinstance(a, ToolCall):
    return ("tool_call", a.name, a.argument)
  if isinstance(a, Answer):
    return ("answer", a.text)
  return ("malformed", a.error)


def _action_from_tree(t) -> Action | None:
  if t is None:
    return None
  kind, *rest = t
  return {"tool_call": ToolCall, "answer": Answer, "malformed": Malformed}[kind](*rest)


def _forced_tree(f: Any):
  return ("ids", tuple(int(i) for i in f)) if isinstance(f, tuple) else _action_tree(f)


def _forced_from_tree(t):
  return tuple(t[1]) if t is not None and t[0] == "ids" else _action_from_tree(t)


def _spec_tree(s: EpisodeSpec) -> dict:
  return {"env": s.env, "seed": int(s.seed), "level": int(s.level), "group": int(s.group),
          "sample_seed": int(s.sample_seed),
          "forced": tuple(_forced_tree(f) for f in s.forced),
          "env_kwargs": tuple((k, v) for k, v in s.env_kwargs)}


def _spec_from_tree(t: dict) -> EpisodeSpec:
  return EpisodeSpec(t["env"], int(t["seed"]), int(t["level"]), int(t["group"]),
                     int(t["sample_seed"]), tuple(_forced_from_tree(f) for f in t["forced"]),
                     tuple(tuple(p) for p in t["env_kwargs"]))


def _message_tree(m: Message) -> tuple:
  ids = None if m.ids is None else tuple(int(i) for i in m.ids)
  return (m.role, m.text, _action_tree(m.action), ids)


def _message_from_tree(t) -> Message:
  role, text, action, ids = t
  return Message(role, text, _action_from_tree(action), None if ids is None else tuple(ids))
