"""The RL run's host-side pieces: which episodes an iteration and an evaluation roll out,
the curriculum built from the config, and the state kept beside the TrainState
(`HostState`: the JSON record saved in the checkpoint's data item plus the pickled paused
episodes and open groups in `<workdir>/rl_state/<step>.pkl`). Every draw is a function of
(rl.seed, iteration, group, member), so a resumed run repeats the same episodes.

Seed ranges: RL task seeds < 2**39, SFT demo seeds in [2**39, 2**39 + sft_demos) (sft.py),
evaluation seeds >= 2**40 (evaluate.py), so training never sees a held-out task.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle

import numpy as np

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.rl import curriculum as curriculum_lib
from hybridmoe_jax.rl import evaluate
from hybridmoe_jax.rl.episode import EpisodeSpec, PendingEpisode, Trajectory
from hybridmoe_jax.train.checkpoint import CorruptStep

TASK_SEED_RANGE = 2**39
STATE_DIR = "rl_state"
REFERENCE_DIR = "reference"


def make_curriculum(rl, state: dict | None = None) -> curriculum_lib.Curriculum:
  """The run's curriculum: fresh, or restored from a checkpoint's `state_dict()`."""
  settings = rl.curriculum
  envs = {n: (e.start_level, e.max_level, e.share) for n, e in rl.envs.items()}
  if state is not None:
    return curriculum_lib.Curriculum.from_state_dict(state, envs, settings)
  return curriculum_lib.Curriculum(envs, settings)


def iteration_specs(rl, iteration: int, first_group: int, cells) -> list[EpisodeSpec]:
  """The episodes of one iteration: a group of group_size per (env, level) cell."""
  out = []
  for g, (env, level) in enumerate(cells):
    group = first_group + g
    task = int(np.random.default_rng([rl.seed, iteration, group, 1]).integers(TASK_SEED_RANGE))
    env_kwargs = tuple(sorted(rl.envs[env].kwargs.items()))
    for j in range(rl.group_size):
      sample_seed = int(np.random.default_rng([rl.seed, iteration, group, j, 2]).integers(2**32))
      out.append(EpisodeSpec(env, task, int(level), group, sample_seed, (), env_kwargs))
  return out


def eval_levels(rl, env: str) -> list[int]:
  levels = rl.eval_levels or range(rl.envs[env].max_level + 1)
  return [lv for lv in levels if lv <= rl.envs[env].max_level]


def eval_specs(rl) -> list[EpisodeSpec]:
  """The held-out episodes: eval_episodes tasks per (env, level), the same every time and
  the same as `run_eval.py --task=agent --seed=0` (rl/evaluate.py's seeds, >= 2**40)."""
  cells = evaluate.build_specs({n: dict(e.kwargs) for n, e in rl.envs.items()},
                               {n: eval_levels(rl, n) for n in rl.envs},
                               episodes=rl.eval_episodes, seed=0)
  return [spec for _, _, specs in cells for spec in specs]


def success_table(trajs: list[Trajectory]) -> dict[str, float]:
  """{"env/L<level>": success rate (reward == 1)} over finished episodes."""
  cells = collections.defaultdict(list)
  for t in trajs:
    cells[f"{t.env_name}/L{t.level}"].append(float(t.reward >= 1.0))
  return {c: float(np.mean(v)) for c, v in sorted(cells.items())}


@dataclasses.dataclass
class HostState:
  """What the RL run keeps besides the TrainState (see the module docstring)."""
  phase: str = "sft"                 # "sft" | "rl"
  iteration: int = 0                 # RL iterations done
  next_group: int = 0
  curriculum: dict | None = None
  eval_history: list = dataclasses.field(default_factory=list)
  pending: list = dataclasses.field(default_factory=list)     # PendingEpisode
  waiting: list = dataclasses.field(default_factory=list)     # Trajectory of open groups

  def record(self) -> dict:
    return {"rl": {"phase": self.phase, "iteration": self.iteration,
                   "next_group": self.next_group, "curriculum": self.curriculum,
                   "eval_history": self.eval_history}}

  def save_episodes(self, workdir: str, step: int) -> None:
    directory = os.path.join(workdir, STATE_DIR)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.pkl")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      pickle.dump({"pending": [p.to_tree() for p in self.pending],
                   "waiting": [t.to_tree() for t in self.waiting]}, f)
    os.replace(tmp, path)

  @classmethod
  def restore(cls, workdir: str, step: int, record: dict) -> "HostState":
    r = record.get("rl")
    if r is None:
      raise ConfigError(f"{workdir}: checkpoint step {step} holds no RL state (a "
                        "pre-training run?): use --config.rl.init_from=<it> in a new workdir")
    path = os.path.join(workdir, STATE_DIR, f"{step}.pkl")
    if not os.path.isfile(path):
      raise CorruptStep(f"{path} is missing: the paused episodes of this step are gone "
                        "(was rl_state/ deleted?)")
    try:
      with open(path, "rb") as f:
        eps = pickle.load(f)
      return cls(r["phase"], r["iteration"], r["next_group"], r["curriculum"],
                 r["eval_history"], [PendingEpisode.from_tree(p) for p in eps["pending"]],
                 [Trajectory.from_tree(t) for t in eps["waiting"]])
    except Exception as e:  # pylint: disable=broad-except  # truncated, garbage, other layout
      raise CorruptStep(f"{path} is unreadable ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:160]})") from None

  @staticmethod
  def prune(workdir: str, keep_steps) -> None:
    """Delete rl_state/<step>.pkl of the steps the checkpoint rotation removed (those older
    than the oldest kept step); newer ones may belong to a save in progress."""
    keep = set(keep_steps)
    directory = os.path.join(workdir, STATE_DIR)
    if not keep or not os.path.isdir(directory):
      return
    for name in os.listdir(directory):
      stem = name[:-len(".pkl")] if name.endswith(".pkl") else ""
      if stem.isdigit() and int(stem) < min(keep) and int(stem) not in keep:
        os.remove(os.path.join(directory, name))
