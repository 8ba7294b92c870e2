"""Finished trajectories -> the padded arrays of one learner batch (host side, numpy).

Conventions: R rows (one episode each, padded up to a multiple of `row_multiple` with empty
rows), T columns (the longest episode rounded up to a multiple of `length_multiple`, so few
shapes compile). Position t of a row predicts token t + 1, so every per-target array is the
trajectory's array shifted left by one:
    tokens       int32 [R, T]    the episode's ids, then 0 (pad)
    segment_ids  int32 [R, T]    1 on real tokens, 0 on padding
    mask         float32 [R, T]  1 where the target token t + 1 was sampled by the policy
                                 (the trajectory's loss_mask, shifted, less forced tokens:
                                 a script's token is not a draw of the behaviour policy)
    lp_old       float32 [R, T]  the behaviour log-prob of target t + 1: the rollout's
                                 `sample_logp`, under the distribution actually sampled
                                 from (temperature, top_p nucleus, renormalised)
    advantage    float32 [R]     per episode (0 on empty rows and on dropped groups)
    centered     float32 [R]     reward - group mean (OPMD's regression target)
    reward       float32 [R]     the shaped reward (environment reward + overlong shaping)
    valid        float32 [R]     1 on rows holding an episode
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hybridmoe_jax.config.rl import RLConfig
from hybridmoe_jax.rl import losses
from hybridmoe_jax.rl.episode import Trajectory


def episode_signals(trajs: Sequence[Trajectory], rl: RLConfig) -> dict[str, np.ndarray]:
  """Per episode: reward (shaped: plus the DAPO soft overlong penalty on its generated
  tokens when rl.overlong_buffer > 0), advantage (rl.advantage; grpo's std with
  rl.adv_std_ddof), centered reward, keep (False on a dropped zero-signal group when
  rl.dynamic_sampling is on)."""
  rewards = np.asarray([t.reward for t in trajs], np.float32)
  if rl.overlong_buffer > 0:
    lengths = np.asarray([t.generated for t in trajs], np.int64)
    rewards = (rewards + losses.overlong_penalty(
        lengths, max_len=rl.max_tokens, buffer=rl.overlong_buffer,
        factor=rl.overlong_penalty)).astype(np.float32)
  groups = np.asarray([t.group for t in trajs], np.int64)
  adv = losses.advantages(rewards, groups, rl.advantage, ddof=rl.adv_std_ddof)
  centered = losses.advantages(rewards, groups, "drgrpo")
  keep = (losses.signal_mask(rewards, groups) if rl.dynamic_sampling
          else np.ones(len(trajs), bool))
  return {"reward": rewards, "advantage": np.where(keep, adv, 0.0).astype(np.float32),
          "centered": np.where(keep, centered, 0.0).astype(np.float32), "keep": keep}


def _round_up(n: int, m: int) -> int:
  return -(-max(n, 1) // m) * m


def build_batch(trajs: Sequence[Trajectory], signals: dict[str, np.ndarray], *,
                row_multiple: int = 1, length_multiple: int = 64,
                max_length: int | None = None) -> dict[str, np.ndarray]:
  """The learner batch of `trajs` (see the module docstring); only episodes with
  signals["keep"] enter it.

  Args:
    trajs: finished episodes; signals: `episode_signals(trajs, ...)`.
    row_multiple: R is rounded up to a multiple of this (the minibatch count x a bucket).
    length_multiple: T is rounded up to a multiple of this.
    max_length: an upper bound for T (the rollout's max_tokens); episodes never exceed it.
  """
  kept = [i for i, k in enumerate(signals["keep"]) if k]
  n_max = max([len(trajs[i].ids) for i in kept], default=1)
  t_len = _round_up(n_max, length_multiple)
  if max_length is not None:
    t_len = max(min(t_len, _round_up(max_length, 8)), n_max)
  rows = _round_up(len(kept), row_multiple)
  out = {k: np.zeros((rows, t_len), np.int32) for k in ("tokens", "segment_ids")}
  out.update({k: np.zeros((rows, t_len), np.float32) for k in ("mask", "lp_old")})
  out.update({k: np.zeros((rows,), np.float32) for k in ("advantage", "centered", "reward",
                                                         "valid")})
  for r, i in enumerate(kept):
    t = trajs[i]
    n = len(t.ids)
    out["tokens"][r, :n] = t.ids
    out["segment_ids"][r, :n] = 1
    sampled = (t.loss_mask[1:] > 0) & (t.forced[1:] == 0)
    out["mask"][r, :n - 1] = sampled
    out["lp_old"][r, :n - 1] = np.where(sampled, t.sample_logp[1:], 0.0)
    for k in ("advantage", "centered", "reward"):
      out[k][r] = signals[k][i]
    out["valid"][r] = 1.0
  return out
