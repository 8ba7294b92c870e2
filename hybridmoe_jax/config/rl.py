"""`rl`: the agentic RL post-training section of a run (DESIGN s9), typed and checked.

A run is an RL run when `rl.envs` names at least one environment; `run_train.py` then runs
`hybridmoe_jax.rl.trainer` (an optional SFT warm start on the environments' oracle
demonstrations, then iterations of rollout -> advantages -> policy updates) instead of
pre-training. The optimizer, clipping, checkpointing and mesh come from the other sections
(`train.optimizer`, `train.clip`, `train.keep_checkpoints`, `mesh`); `train.lr` is the RL
learning rate (constant after a linear warmup of `train.warmup` updates), `rl.sft_learning_rate`
the SFT warm start's.

Terms: an iteration rolls out `groups_per_iter` groups of `group_size` episodes (one task
each, sampled by the curriculum: `CurriculumSettings`, the `rl.curriculum_*` and
`rl.promote_*` fields) and makes `updates_per_batch` passes over them in `minibatches`
optimizer steps each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridmoe_jax.config import Checked, ranged, require

ADVANTAGES = ("grpo", "drgrpo", "rloo")
POLICY_LOSSES = ("clip", "gspo", "opmd")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("none", "k1", "k3")


@dataclasses.dataclass(frozen=True)
class CurriculumSettings(Checked):
  """How the RL curriculum (rl/curriculum.py) weights and promotes levels; the `rl` section
  holds these as `rl.<RL_CURRICULUM_FIELDS key>` (same defaults and ranges).

  ema: decay of a cell's success EMA per update. target: sampling favours levels whose EMA
  is near this success rate. width: a level's weight is exp(-((ema - target) / width)^2).
  floor: the least weight of an unlocked level (none starves). promote_at: the frontier's
  EMA that unlocks the next level, together with at least min_episodes episodes there.
  """

  PATH = "CurriculumSettings"
  ema: float = ranged(0.7, "(0, 1)")
  target: float = ranged(0.5, "[0, 1]")
  width: float = ranged(0.25, "> 0")
  floor: float = ranged(0.05, "[0, 1]")
  promote_at: float = ranged(0.7, "[0, 1]")
  min_episodes: int = ranged(16, ">= 0")


# rl.<field> -> the CurriculumSettings field it sets.
RL_CURRICULUM_FIELDS = {"curriculum_ema": "ema", "curriculum_target": "target",
                        "curriculum_width": "width", "curriculum_floor": "floor",
                        "promote_at": "promote_at", "promote_min_episodes": "min_episodes"}


def _curriculum(name: str):
  """The `rl` field of CurriculumSettings' `name`: its default and range."""
  f = CurriculumSettings.__dataclass_fields__[name]
  return dataclasses.field(default=f.default, metadata=f.metadata)


@dataclasses.dataclass(frozen=True)
class RLEnvConfig(Checked):
  """`rl.envs.<name>`: one environment of the mix (the key is its registered name)."""

  share: float = ranged(1.0, "> 0")  # relative share of the groups drawn from this environment
  start_level: int = ranged(0, ">= 0")  # the curriculum's first frontier
  max_level: int = ranged(4, ">= 0")    # the highest level the curriculum may unlock
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # make_env arguments

  def check(self, p: str) -> None:
    require(self.max_level >= self.start_level, f"{p}.max_level", self.max_level,
            f"an integer >= start_level ({self.start_level})")


@dataclasses.dataclass(frozen=True)
class RLConfig(Checked):
  """`rl`: see the module docstring. Empty `envs`: not an RL run."""

  PATH = "rl"
  envs: dict[str, RLEnvConfig] = dataclasses.field(default_factory=dict)
  # 0: the SFT warm start only (and the iteration-0 eval)
  iterations: int = ranged(100, ">= 0")
  seed: int = ranged(0, ">= 0")        # task seeds, sampling seeds, curriculum draws
  # --- rollouts
  group_size: int = ranged(8, ">= 1")
  groups_per_iter: int = ranged(4, ">= 1")
  rollout_batch: int = ranged(32, ">= 1")  # cache rows (episodes in flight at once)
  max_tokens: int = ranged(512, ">= 8")    # per episode (prompt, turns, tool results)
  max_turn_tokens: int = ranged(48, ">= 1")
  # generated tokens per episode per iteration
  token_budget: int = ranged(0, ">= 0", "0: no pausing")
  # The behaviour policy IS the sampling distribution (temperature, then the top_p nucleus,
  # renormalised): rollouts record its log-probs and the learner trains it (rl/learner.py).
  temperature: float = ranged(1.0, "(0, 100]", "training rollouts sample; greedy has no "
                              "gradient")
  top_p: float = ranged(1.0, "(0, 1]")
  prefill_chunk: int = ranged(128, ">= 1")
  # --- the objective
  advantage: str = ranged("grpo", ADVANTAGES)
  loss: str = ranged("clip", POLICY_LOSSES)
  loss_agg_mode: str = ranged("token-mean", AGG_MODES)
  eps_low: float = ranged(0.2, "[0, 1]")
  eps_high: float = ranged(0.28, "[0, 10]")   # clip-higher (DAPO)
  # GSPO clips the sequence ratio s_i = exp(mean_t log rho_t), which stays within ~1e-3 of 1
  # where token ratios move by ~0.1: its own range (the GSPO paper's 3e-4 / 4e-4)
  gspo_eps_low: float = ranged(3e-4, "[0, 1]")
  gspo_eps_high: float = ranged(4e-4, "[0, 10]")
  # grpo's group std: 1 = sample std (TRL, verl: torch.std), 0 = population std
  adv_std_ddof: int = ranged(1, (0, 1))
  opmd_tau: float = ranged(1.0, "[1e-6, 1e6]")
  kl: str = ranged("none", KL_KINDS)   # KL to the frozen reference (the policy at RL start)
  kl_beta: float = ranged(0.0, "[0, 1e6]", "> 0 unless rl.kl = 'none'")
  dynamic_sampling: bool = True  # drop groups whose rewards are all equal (DAPO)
  # DAPO soft overlong shaping over the last tokens (below max_tokens)
  overlong_buffer: int = ranged(0, ">= 0", "0: off")
  overlong_penalty: float = ranged(1.0, "[0, 1e6]")
  minibatches: int = ranged(1, ">= 1")
  updates_per_batch: int = ranged(1, ">= 1")
  routing_replay: bool = False  # replay the rollout policy's routed experts when training
  update_biases: bool = False   # keep updating the QB routing biases during RL
  # --- curriculum (CurriculumSettings: ema, target, width, floor, promote_at, min_episodes)
  curriculum_ema: float = _curriculum("ema")
  curriculum_target: float = _curriculum("target")
  curriculum_width: float = _curriculum("width")
  curriculum_floor: float = _curriculum("floor")
  promote_at: float = _curriculum("promote_at")
  promote_min_episodes: int = _curriculum("min_episodes")
  # --- SFT warm start on oracle demonstrations (0 steps: none)
  sft_steps: int = ranged(0, ">= 0")
  sft_batch: int = ranged(16, ">= 1")
  sft_levels: tuple[int, ...] = ranged((0, 1), ">= 0", nonempty=True)
  sft_learning_rate: float = ranged(1e-3, "[0, 10]")
  sft_demos: int = ranged(2048, ">= 1")  # distinct oracle episodes per environment
  init_from: str = ""           # a workdir or params export to start from (skips SFT)
  # --- evaluation, logging, checkpoints
  eval_every: int = ranged(10, ">= 0", "iterations; 0: only at the end")
  eval_episodes: int = ranged(32, ">= 1")  # held-out episodes per (env, level), greedy
  eval_levels: tuple[int, ...] = ranged((), ">= 0", "empty: 0 .. each env's max_level")
  save_every: int = ranged(10, ">= 1")      # iterations
  # sample trajectories per iteration to trajectories.jsonl
  log_trajectories: int = ranged(2, ">= 0")

  @property
  def enabled(self) -> bool:
    return bool(self.envs)

  @property
  def curriculum(self) -> CurriculumSettings:
    """The curriculum settings these fields hold."""
    return CurriculumSettings(**{v: getattr(self, k) for k, v in RL_CURRICULUM_FIELDS.items()})

  def check(self, p: str) -> None:
    require(self.overlong_buffer < self.max_tokens, f"{p}.overlong_buffer",
            self.overlong_buffer, f"an integer in [0, max_tokens) = [0, {self.max_tokens})")
    require(self.kl == "none" or self.kl_beta > 0, f"{p}.kl_beta", self.kl_beta,
            f"a number > 0 with rl.kl = {self.kl!r} (or rl.kl = 'none')")
    n = self.group_size * self.groups_per_iter
    require(n % self.minibatches == 0, f"{p}.minibatches", self.minibatches,
            f"a divisor of group_size x groups_per_iter = {n}")
