"""The RL curriculum (DESIGN s9): per (env, level) cell a success EMA; levels are sampled
near 50% success and the next level unlocks when the frontier's EMA passes a threshold.

Conventions: an env is a registered environment name; a level is an int in [0, max_level]
(the environment's difficulty / horizon knob). Per env, levels 0..frontier are unlocked;
the frontier starts at the env's start_level and grows by at most one level per `update`.
A cell's EMA is None until its first episode. Envs are always walked in sorted name order,
so draws depend only on the state and the numpy Generator, never on dict order.
numpy + python only: the state is plain ints / floats / str keys (state_dict is JSON-able
and saved with the checkpoint). Settings and env ranges are the `rl` section's
(`rl_config.CurriculumSettings`, `RLEnvConfig`).
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from hybridmoe_jax.config import check_tree, is_int, is_number
from hybridmoe_jax.config.rl import CurriculumSettings, RLEnvConfig

_STATE_VERSION = 1


def _checked_envs(envs: Mapping[str, Any]) -> dict[str, tuple[int, int, float]]:
  """name -> (start_level, max_level, weight), checked and normalised to python types."""
  if not isinstance(envs, Mapping) or not envs:
    raise ValueError(f"envs = {envs!r}: allowed a non-empty mapping name -> (start_level, "
                     "max_level, weight)")
  out = {}
  for name, spec in envs.items():
    if not isinstance(name, str) or not name or "/" in name:
      raise ValueError(f"envs: name {name!r}: allowed a non-empty str without '/'")
    if not isinstance(spec, (tuple, list)) or len(spec) != 3:
      raise ValueError(f"envs[{name!r}] = {spec!r}: allowed (start_level, max_level, weight)")
    start, top, weight = spec  # the ranges of the `rl.envs` entries they come from
    check_tree(RLEnvConfig(share=weight, start_level=start, max_level=top), f"rl.envs.{name}")
    out[name] = (int(start), int(top), float(weight))
  return out


class Curriculum:
  """Success EMAs per (env, level), level sampling near the target, promotion.

  Args:
    envs: name -> (start_level, max_level, env weight > 0). start_level is the initial
      frontier; levels below it are unlocked too.
    settings: CurriculumSettings.
  """

  def __init__(self, envs: Mapping[str, tuple[int, int, float]],
               settings: CurriculumSettings = CurriculumSettings()):
    if not isinstance(settings, CurriculumSettings):
      raise ValueError(f"settings = {settings!r}: allowed a CurriculumSettings")
    self.settings = settings
    self._envs = _checked_envs(envs)
    self._names = sorted(self._envs)
    self._frontier = {n: self._envs[n][0] for n in self._names}
    self._ema: dict[str, list[Optional[float]]] = {
        n: [None] * (self._envs[n][1] + 1) for n in self._names}
    self._episodes = {n: [0] * (self._envs[n][1] + 1) for n in self._names}

  # ------------------------------------------------------------------------------ queries

  def _check_cell(self, env, level=None) -> None:
    if env not in self._envs:
      raise ValueError(f"env = {env!r}: allowed one of {self._names}")
    if level is not None:
      top = self._envs[env][1]
      if not (is_int(level) and 0 <= level <= top):
        raise ValueError(f"level = {level!r} for env {env!r}: allowed an int in [0, {top}]")

  def frontier(self, env: str) -> int:
    """The highest unlocked level of env."""
    self._check_cell(env)
    return self._frontier[env]

  def ema(self, env: str, level: int) -> Optional[float]:
    """The success EMA of the cell, None before its first episode."""
    self._check_cell(env, level)
    return self._ema[env][level]

  def episodes(self, env: str, level: int) -> int:
    """Finished episodes recorded for the cell."""
    self._check_cell(env, level)
    return self._episodes[env][level]

  def level_weights(self, env: str) -> np.ndarray:
    """float64 [frontier + 1]: sampling probabilities of the unlocked levels of env.

    weight = max(exp(-((ema - target) / width)^2), floor); an unseen level counts as
    ema = target (weight 1: nothing is known about it yet). All-zero weights (floor 0 and
    every level far from the target) fall back to uniform.
    """
    self._check_cell(env)
    s = self.settings
    ema = [s.target if e is None else e for e in self._ema[env][:self._frontier[env] + 1]]
    w = np.maximum(np.exp(-((np.asarray(ema) - s.target) / s.width)**2), s.floor)
    total = w.sum()
    return w / total if total > 0 else np.full(w.shape, 1.0 / w.size)

  # ----------------------------------------------------------------------------- sampling

  def sample(self, rng: np.random.Generator, n: int) -> list[tuple[str, int]]:
    """n draws of (env, level): the env by its weight, the level among the unlocked ones
    by `level_weights`. Deterministic given the state and rng's state."""
    if not isinstance(rng, np.random.Generator):
      raise ValueError(f"rng = {rng!r}: allowed a numpy.random.Generator")
    if not (is_int(n) and n >= 0):
      raise ValueError(f"n = {n!r}: allowed an int >= 0")
    weights = np.array([self._envs[name][2] for name in self._names])
    env_idx = rng.choice(len(self._names), size=n, p=weights / weights.sum())
    levels = np.zeros(n, np.int64)
    for k, name in enumerate(self._names):
      rows = np.flatnonzero(env_idx == k)
      if rows.size:
        p = self.level_weights(name)
        levels[rows] = rng.choice(p.size, size=rows.size, p=p)
    return [(self._names[k], int(lv)) for k, lv in zip(env_idx, levels)]

  # ------------------------------------------------------------------------------ updates

  def update(self, results: Iterable[tuple[str, int, float]]) -> list[dict]:
    """Records finished episodes, then promotes.

    Per (env, level) cell with results, the batch mean m of the successes updates
    ema <- ema * decay + (1 - decay) * m (the first update sets ema = m); the episode count
    grows by the cell's results. Then per env (at most one level per update): if the
    frontier is below max_level, its EMA >= promote_at and it has >= min_episodes episodes,
    the next level unlocks.

    Args:
      results: (env, level, success in [0, 1]) per finished episode; any level in
        [0, max_level] (an episode above the frontier is recorded but unlocks nothing).

    Returns:
      promotion events [{"env", "from", "to", "ema", "episodes"}], in env name order.
    """
    batch = list(results)
    for i, item in enumerate(batch):
      if not isinstance(item, (tuple, list)) or len(item) != 3:
        raise ValueError(f"results[{i}] = {item!r}: allowed (env, level, success)")
      env, level, success = item
      self._check_cell(env, level)
      if not (is_number(success) and 0.0 <= success <= 1.0):
        raise ValueError(f"results[{i}].success = {success!r}: allowed a float in [0, 1]")
    sums: dict[tuple[str, int], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for env, level, success in batch:
      cell = sums[(env, int(level))]
      cell[0] += float(success)
      cell[1] += 1
    decay = self.settings.ema
    for (env, level), (total, count) in sorted(sums.items()):
      mean = total / count
      old = self._ema[env][level]
      self._ema[env][level] = mean if old is None else old * decay + (1.0 - decay) * mean
      self._episodes[env][level] += count
    return self._promote()

  def _promote(self) -> list[dict]:
    events = []
    s = self.settings
    for name in self._names:
      f = self._frontier[name]
      ema, count = self._ema[name][f], self._episodes[name][f]
      if (f < self._envs[name][1] and ema is not None and ema >= s.promote_at
          and count >= s.min_episodes):
        self._frontier[name] = f + 1
        events.append({"env": name, "from": f, "to": f + 1, "ema": ema, "episodes": count})
    return events

  # ------------------------------------------------------------------------ serialisation

  def summary(self) -> dict:
    """Flat JSON-able metrics: {"env/level": {"ema", "episodes"}} for every cell with
    episodes, and {"frontier/env": int} for every env."""
    out: dict[str, Any] = {}
    for name in self._names:
      for level, count in enumerate(self._episodes[name]):
        if count:
          out[f"{name}/{level}"] = {"ema": self._ema[name][level], "episodes": count}
      out[f"frontier/{name}"] = self._frontier[name]
    return out

  def state_dict(self) -> dict:
    """JSON-able state: the envs it was built with, frontiers and every cell."""
    return {
        "version": _STATE_VERSION,
        "envs": {n: list(self._envs[n]) for n in self._names},
        "frontier": dict(self._frontier),
        "cells": {n: {str(level): {"ema": self._ema[n][level],
                                   "episodes": self._episodes[n][level]}
                      for level in range(len(self._ema[n]))}
                  for n in self._names},
    }

  @classmethod
  def from_state_dict(cls, state: Mapping[str, Any], envs: Mapping[str, tuple[int, int, float]],
                      settings: CurriculumSettings = CurriculumSettings()) -> "Curriculum":
    """Rebuilds a Curriculum from state_dict() (also after a JSON round trip), exactly.

    Raises ValueError if `envs` differs from the saved envs (names, levels or weights) or
    the state is malformed. Settings may change on resume.
    """
    out = cls(envs, settings)
    if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
      raise ValueError(f"state.version: allowed {_STATE_VERSION}, got "
                       f"{state.get('version') if isinstance(state, Mapping) else state!r}")
    saved = state.get("envs")
    if not isinstance(saved, Mapping) or sorted(saved) != out._names:
      raise ValueError(f"envs: names {out._names} differ from the saved ones "
                       f"{sorted(saved) if isinstance(saved, Mapping) else saved!r}")
    for name in out._names:
      if tuple(saved[name]) != out._envs[name]:
        raise ValueError(f"envs[{name!r}] = {out._envs[name]}: differs from the saved "
                         f"(start_level, max_level, weight) = {tuple(saved[name])}")
      top = out._envs[name][1]
      f = state.get("frontier", {}).get(name)
      if not (is_int(f) and out._envs[name][0] <= f <= top):
        raise ValueError(f"state.frontier[{name!r}] = {f!r}: allowed an int in "
                         f"[{out._envs[name][0]}, {top}]")
      out._frontier[name] = int(f)
      cells = state.get("cells", {}).get(name)
      if not isinstance(cells, Mapping) or set(cells) != {str(v) for v in range(top + 1)}:
        raise ValueError(f"state.cells[{name!r}]: allowed one entry per level 0..{top}")
      for level in range(top + 1):
        cell = cells[str(level)]
        ema, count = cell.get("ema"), cell.get("episodes")
        if not (ema is None or (is_number(ema) and 0.0 <= ema <= 1.0)):
          raise ValueError(f"state.cells[{name!r}][{level}].ema = {ema!r}: allowed None or "
                           "a float in [0, 1]")
        if not (is_int(count) and count >= 0) or (ema is None) != (count == 0):
          raise ValueError(f"state.cells[{name!r}][{level}].episodes = {count!r}: allowed an "
                           "int >= 0, 0 exactly when ema is None")
        out._ema[name][level] = None if ema is None else float(ema)
        out._episodes[name][level] = int(count)
    return out
