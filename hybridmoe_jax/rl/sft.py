"""SFT warm start: batches of oracle demonstrations, trained with the pre-training step.

Every environment of `rl.envs` renders `rl.sft_demos` solved episodes per level of
`rl.sft_levels` (clipped to the env's max_level) with the run's chat tokenizer
(rl/demos.py). Demo seeds live in [2**39, 2**39 + sft_demos), apart from the RL tasks'
(< 2**39) and the evaluation's ([2**40, 2**41)). A batch holds `sft_batch` demos drawn by
np.random.default_rng([seed, step]) (so a resumed run sees the same batches), one per row,
padded to the longest demo rounded up to 64:
    tokens int32 [B, T], segment_ids int32 [B, T] (1 real, 0 pad),
    loss_weights float32 [B, T] = the assistant mask: only the assistant's tokens are
    learned (train/step.py: the weight of each token as a target).
"""

from __future__ import annotations

import numpy as np

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.rl import demos as demos_lib
from hybridmoe_jax.rl.envs.base import make_env
from hybridmoe_jax.config.rl import RLConfig

DEMO_SEED_BASE = 2**39


def build_demos(rl: RLConfig, tokenizer) -> list[demos_lib.Demo]:
  """Every demo of the warm start, in a fixed order."""
  out = []
  for name, env_cfg in rl.envs.items():
    env = make_env(name, **env_cfg.kwargs)
    levels = sorted({min(lv, env_cfg.max_level, env.max_level) for lv in rl.sft_levels})
    for level in levels:
      seeds = range(DEMO_SEED_BASE, DEMO_SEED_BASE + rl.sft_demos)
      out.extend(demos_lib.oracle_demos(env, tokenizer, level=level, seeds=seeds))
  return out


class DemoBatches:
  """batch(step) -> the SFT batch of optimizer step `step` (deterministic in step)."""

  def __init__(self, demos: list[demos_lib.Demo], batch: int, seed: int, max_len: int):
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
