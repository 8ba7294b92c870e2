"""SFT warm start: oracle demonstrations, in batches trained with the pre-training step.

`oracle_conversation(env, seed, level)` plays the env's oracle through `env.step` (so a demo
is exactly what the environment answers) and returns the messages; `oracle_demos` renders
many of them with a chat tokenizer into (ids, assistant_mask) pairs.

Every environment of `rl.envs` renders `rl.sft_demos` solved episodes per level of
`rl.sft_levels` (clipped to the env's max_level) with the run's chat tokenizer
(`oracle_demos`). Demo seeds live in [2**39, 2**39 + sft_demos), apart from the RL tasks'
(< 2**39) and the evaluation's ([2**40, 2**41)). A batch holds `sft_batch` demos drawn by
np.random.default_rng([seed, step, 7]) (so a resumed run sees the same batches), one per row,
padded to the longest demo rounded up to 64:
    tokens int32 [B, T], segment_ids int32 [B, T] (1 real, 0 pad),
    loss_weights float32 [B, T] = the assistant mask: only the assistant's tokens are
    learned (train/step.py: the weight of each token as a target).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.rl import RLConfig
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.envs.base import Environment, make_env

DEMO_SEED_BASE = 2**39


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


def build_demos(rl: RLConfig, tokenizer) -> list[Demo]:
  """Every demo of the warm start, in a fixed order."""
  out = []
  for name, env_cfg in rl.envs.items():
    env = make_env(name, **env_cfg.kwargs)
    levels = sorted({min(lv, env_cfg.max_level, env.max_level) for lv in rl.sft_levels})
    for level in levels:
      seeds = range(DEMO_SEED_BASE, DEMO_SEED_BASE + rl.sft_demos)
      out.extend(oracle_demos(env, tokenizer, level=level, seeds=seeds))
  return out


class DemoBatches:
  """batch(step) -> the SFT batch of optimizer step `step` (deterministic in step)."""

  def __init__(self, demos: list[Demo], batch: int, seed: int, max_len: int):
    if not demos:
      raise ValueError("rl SFT: no demonstrations (rl.envs is empty)")
    longest = max(len(d.ids) for d in demos)
    if longest > max_len:
      raise ConfigError(f"config field `rl.max_tokens` = {max_len} is below the longest SFT "
                        f"demonstration ({longest} tokens): raise rl.max_tokens or lower "
                        "rl.sft_levels")
    self.demos, self.batch, self.seed = demos, batch, seed
    self.seq_len = -(-longest // 64) * 64

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, step, 7])
    pick = rng.choice(len(self.demos), size=self.batch, replace=len(self.demos) < self.batch)
    out = {"tokens": np.zeros((self.batch, self.seq_len), np.int32),
           "segment_ids": np.zeros((self.batch, self.seq_len), np.int32),
           "loss_weights": np.zeros((self.batch, self.seq_len), np.float32)}
    for r, i in enumerate(pick):
      d = self.demos[int(i)]
      n = len(d.ids)
      out["tokens"][r, :n] = d.ids
      out["segment_ids"][r, :n] = 1
      out["loss_weights"][r, :n] = d.assistant_mask
    return out
