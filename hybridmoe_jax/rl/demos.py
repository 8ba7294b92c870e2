"""Oracle demonstrations: full solved conversations of an environment, for SFT warm start.

`oracle_conversation(env, seed, level)` plays the env's oracle through `env.step` (so a demo
is exactly what the environment answers) and returns the messages; `oracle_demos` renders
many of them with a chat tokenizer into (ids, assistant_mask) pairs: train with the mask
as the loss weights so only the assistant's tokens are learned.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.envs.base import Environment, make_env


@dataclasses.dataclass(frozen=True)
class Demo:
  """One solved episode.

  Attributes:
    env, seed, level: where it came from.
    messages: system, user, then assistant / tool_result turns, ending with the answer.
    ids: int32 [n] the rendered conversation (bos first).
    assistant_mask: int32 [n] 1 on assistant-generated tokens.
    reward: the environment's reward for the oracle (always 1.0).
  """
  env: str
  seed: int
  level: int
  messages: tuple[chat_format.Message, ...]
  ids: np.ndarray
  assistant_mask: np.ndarray
  reward: float


def oracle_conversation(env: Environment, seed: int, level: int
                        ) -> tuple[list[chat_format.Message], float]:
  """Plays the oracle of episode (seed, level): (messages, final reward).

  Raises:
    RuntimeError: the oracle did not finish the episode with reward 1 (a broken env).
  """
  obs = env.reset(seed, level)
  messages = chat_format.initial_messages(obs)
  result = None
  for action in env.oracle():
    messages.append(chat_format.Message("assistant", action=action))
    result = env.step(action)
    if result.done:
      break
    messages.append(chat_format.Message("tool_result", result.text))
  if result is None or not result.done or result.reward != 1.0:
    got = "no step" if result is None else f"reward {result.reward}, {result.finish_reason}"
    raise RuntimeError(f"{env.name}: the oracle of seed {seed} level {level} did not solve "
                       f"the episode ({got})")
  return messages, result.reward


def oracle_demos(env: str | Environment, tokenizer, *, level: int, seeds: Iterable[int]
                 ) -> list[Demo]:
  """Rendered oracle conversations of `env` at `level`, one per seed.

  Args:
    env: a registered name or an Environment.
    tokenizer: with all CHAT_ROLES ids (e.g. ByteTokenizer(chat=True)).
    level: the difficulty.
    seeds: episode seeds.
  """
  env = make_env(env) if isinstance(env, str) else env
  chat_format.chat_ids(tokenizer)   # fail before any episode on a tokenizer without roles
  out = []
  for seed in seeds:
    messages, reward = oracle_conversation(env, seed, level)
    r = chat_format.render(tokenizer, messages)
    out.append(Demo(env.name, int(seed), int(level), tuple(messages), r.ids,
                    r.assistant_mask, reward))
  return out
