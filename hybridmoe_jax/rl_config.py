"""`rl`: the agentic RL post-training section of a run (DESIGN s9), typed and checked.

A run is an RL run when `rl.envs` names at least one environment; `run_train.py` then runs
`hybridmoe_jax.rl.trainer` (an optional SFT warm start on the environments' oracle
demonstrations, then iterations of rollout -> advantages -> policy updates) instead of
pre-training. The optimizer, clipping, checkpointing and mesh come from the other sections
(`train.optimizer`, `train.clip`, `train.keep_checkpoints`, `mesh`); `train.learning_rate`
is the RL learning rate (constant after `train.warmup_steps`).

Terms: an iteration rolls out `groups_per_iter` groups of `group_size` episodes (one task
each, sampled by the curriculum) and makes `updates_per_batch` passes over them in
`minibatches` optimizer steps each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridmoe_jax.config import require

ADVANTAGES = ("grpo", "drgrpo", "rloo")
POLICY_LOSSES = ("clip", "gspo", "opmd")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("none", "k1", "k3")


@dataclasses.dataclass(frozen=True)
class RLEnvConfig:
  """`rl.envs.<name>`: one environment of the mix (the key is its registered name)."""

  share: float = 1.0           # relative share of the groups drawn from this environment
  start_level: int = 0         # the curriculum's first frontier
  max_level: int = 4           # the highest level the curriculum may unlock
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # make_env arguments

  def check(self, p: str) -> None:
    require(self.share > 0, f"{p}.share", self.share, "a number > 0")
    require(self.start_level >= 0, f"{p}.start_level", self.start_level, "an integer >= 0")
    require(self.max_level >= self.start_level, f"{p}.max_level", self.max_level,
            f"an integer >= start_level ({self.start_level})")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """`rl`: see the module docstring. Empty `envs`: not an RL run."""

  envs: dict[str, RLEnvConfig] = dataclasses.field(default_factory=dict)
  iterations: int = 100        # 0: the SFT warm start only (and the iteration-0 eval)
  seed: int = 0                 # task seeds, sampling seeds, curriculum draws
  # --- rollouts
  group_size: int = 8
  groups_per_iter: int = 4
  rollout_batch: int = 32       # cache rows (episodes in flight at once)
  max_tokens: int = 512         # per episode (prompt, turns, tool results)
  max_turn_tokens: int = 48
  token_budget: int = 0         # generated tokens per episode per iteration; 0 = no pausing
  # The behaviour policy IS the sampling distribution (temperature, then the top_p nucleus,
  # renormalised): rollouts record its log-probs and the learner trains it (rl/learner.py).
  temperature: float = 1.0
  top_p: float = 1.0
  prefill_chunk: int = 128
  # --- the objective
  advantage: str = "grpo"
  loss: str = "clip"
  loss_agg_mode: str = "token-mean"
  eps_low: float = 0.2
  eps_high: float = 0.28        # clip-higher (DAPO)
  # GSPO clips the sequence ratio s_i = exp(mean_t log rho_t), which stays within ~1e-3 of 1
  # where token ratios move by ~0.1: its own range (the GSPO paper's 3e-4 / 4e-4)
  gspo_eps_low: float = 3e-4
  gspo_eps_high: float = 4e-4
  # grpo's group std: 1 = sample std (TRL, verl: torch.std), 0 = population std
  adv_std_ddof: int = 1
  opmd_tau: float = 1.0
  kl: str = "none"              # KL to the frozen reference (the policy at RL start)
  kl_beta: float = 0.0
  dynamic_sampling: bool = True  # drop groups whose rewards are all equal (DAPO)
  overlong_buffer: int = 0      # DAPO soft overlong shaping over the last tokens; 0 = off
  overlong_penalty: float = 1.0
  minibatches: int = 1
  updates_per_batch: int = 1
  routing_replay: bool = False  # replay the rollout policy's routed experts when training
  update_biases: bool = False   # keep updating the QB routing biases during RL
  # --- curriculum (rl/curriculum.py)
  curriculum_ema: float = 0.7
  curriculum_target: float = 0.5
  curriculum_width: float = 0.25
  curriculum_floor: float = 0.05
  promote_at: float = 0.7
  promote_min_episodes: int = 16
  # --- SFT warm start on oracle demonstrations (0 steps: none)
  sft_steps: int = 0
  sft_batch: int = 16
  sft_levels: tuple[int, ...] = (0, 1)
  sft_learning_rate: float = 1e-3
  sft_demos: int = 2048         # distinct oracle episodes per environment
  init_from: str = ""           # a workdir or params export to start from (skips SFT)
  # --- evaluation, logging, checkpoints
  eval_every: int = 10          # iterations; 0 = only at the end
  eval_episodes: int = 32       # held-out episodes per (env, level), greedy
  eval_levels: tuple[int, ...] = ()  # () = 0 .. max_level of each env
  save_every: int = 10          # iterations
  log_trajectories: int = 2     # sample trajectories per iteration to trajectories.jsonl

  @property
  def enabled(self) -> bool:
    return bool(self.envs)

  def __post_init__(self):
    p = "rl"
    for name, env in self.envs.items():
      env.check(f"{p}.envs.{name}")
    for name, lo in (("iterations", 0), ("group_size", 1), ("groups_per_iter", 1),
                     ("rollout_batch", 1), ("max_tokens", 8), ("max_turn_tokens", 1),
                     ("token_budget", 0), ("prefill_chunk", 1), ("minibatches", 1),
                     ("updates_per_batch", 1), ("promote_min_episodes", 1), ("sft_steps", 0),
                     ("sft_batch", 1), ("sft_demos", 1), ("eval_every", 0),
                     ("eval_episodes", 1), ("save_every", 1), ("log_trajectories", 0),
                     ("overlong_buffer", 0), ("seed", 0)):
      v = getattr(self, name)
      require(v >= lo, f"{p}.{name}", v, f"an integer >= {lo}")
    for name, allowed in (("advantage", ADVANTAGES), ("loss", POLICY_LOSSES),
                          ("loss_agg_mode", AGG_MODES), ("kl", KL_KINDS)):
      require(getattr(self, name) in allowed, f"{p}.{name}", getattr(self, name),
              f"one of {allowed}")
    require(0.0 < self.temperature <= 100.0, f"{p}.temperature", self.temperature,
            "a number in (0, 100] (training rollouts sample; greedy has no gradient)")
    for name, lo, hi in (("top_p", 1e-6, 1.0),
                         ("eps_low", 0.0, 1.0), ("eps_high", 0.0, 10.0),
                         ("gspo_eps_low", 0.0, 1.0), ("gspo_eps_high", 0.0, 10.0),
                         ("opmd_tau", 1e-6, 1e6), ("kl_beta", 0.0, 1e6),
                         ("overlong_penalty", 0.0, 1e6), ("curriculum_ema", 1e-3, 0.999),
                         ("curriculum_target", 0.0, 1.0), ("curriculum_width", 1e-3, 10.0),
                         ("curriculum_floor", 0.0, 1.0), ("promote_at", 0.0, 1.0),
                         ("sft_learning_rate", 0.0, 10.0)):
      v = getattr(self, name)
      require(lo <= v <= hi, f"{p}.{name}", v, f"a number in [{lo}, {hi}]")
    require(self.adv_std_ddof in (0, 1) and not isinstance(self.adv_std_ddof, bool),
            f"{p}.adv_std_ddof", self.adv_std_ddof, "0 or 1")
    require(self.overlong_buffer < self.max_tokens, f"{p}.overlong_buffer",
            self.overlong_buffer, f"an integer in [0, max_tokens) = [0, {self.max_tokens})")
    require(self.kl == "none" or self.kl_beta > 0, f"{p}.kl_beta", self.kl_beta,
            f"a number > 0 with rl.kl = {self.kl!r} (or rl.kl = 'none')")
    require(all(v >= 0 for v in self.sft_levels) and len(self.sft_levels) > 0,
            f"{p}.sft_levels", self.sft_levels, "a non-empty tuple of levels >= 0")
    require(all(v >= 0 for v in self.eval_levels), f"{p}.eval_levels", self.eval_levels,
            "levels >= 0 (empty: 0 .. each env's max_level)")
    n = self.group_size * self.groups_per_iter
    require(n % self.minibatches == 0, f"{p}.minibatches", self.minibatches,
            f"a divisor of group_size x groups_per_iter = {n}")
