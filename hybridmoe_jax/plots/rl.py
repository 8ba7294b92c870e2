"""Agentic RL figures: success rate per level over RL iterations, the RL run's curves
(SFT loss over SFT steps; reward, success, loss, entropy over iterations), agent-eval bars.

Inputs are plain numbers: success rates are floats in [0, 1] (None / NaN: not evaluated).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from hybridmoe_jax.plots.figure import new_figure

# Fixed colours for the run_eval policies; any other label takes the next free colour.
_POLICY_COLOURS = {"model": "C0", "oracle": "C2", "random": "C7"}


def success_by_level(steps: Sequence[int], series: Mapping[str, Sequence[float | None]], *,
                     title: str = "Success rate by level", xlabel: str = "step") -> Figure:
  """One line per series over training steps; None (not evaluated at that step) leaves a
  gap, and every evaluated point carries a marker (a lone point stays visible).

  Args:
    steps: the x values [S].
    series: label (e.g. "arithmetic/L1") -> success rate per step [S], each in [0, 1] or
      None.
    title: the axes title.
    xlabel: what the x values count ("RL iteration" for an RL run's evaluations).

  Raises:
    ValueError: a series whose length is not len(steps) (named).
  """
  steps = np.asarray(steps, np.float64)
  fig = new_figure(9.0, 4.5)
  ax = fig.add_subplot()
  for label, values in series.items():
    if len(values) != len(steps):
      raise ValueError(f"series {label!r} has {len(values)} values; steps has {len(steps)}")
    y = np.array([np.nan if v is None else float(v) for v in values], np.float64)
    ax.plot(steps, y, "o-", ms=3, lw=1.2, label=label)
  if not series:
    ax.text(0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=ax.transAxes)
  else:
    ax.legend(fontsize=8, loc="best", ncol=1 + len(series) // 8)
  ax.set_ylim(-0.03, 1.03)
  ax.set_xlabel(xlabel)
  ax.set_ylabel("success rate (reward = 1)")
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  return fig


def _points(records: Sequence[Mapping[str, Any]], x: str, y: str
            ) -> tuple[np.ndarray, np.ndarray]:
  """(x, y) of the records holding both as finite numbers."""
  pts = [(float(r[x]), float(r[y])) for r in records
         if all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                and np.isfinite(float(r[k])) for k in (x, y))]
  if not pts:
    return np.zeros(0), np.zeros(0)
  xs, ys = zip(*pts)
  return np.asarray(xs), np.asarray(ys)


def _panel(ax, records, x: str, keys: Sequence[tuple[str, str]], *, xlabel: str,
           title: str) -> None:
  """One line per (key, label) that has points; else a 'not logged' note."""
  drawn = 0
  for key, label in keys:
    xs, ys = _points(records, x, key)
    if len(xs):
      ax.plot(xs, ys, "o-" if len(xs) < 30 else "-", ms=3, lw=1.2, label=label)
      drawn += 1
  if drawn:
    ax.legend(fontsize=8, loc="best")
  else:
    ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
  ax.set_xlabel(xlabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)


def rl_training_figure(sft: Sequence[Mapping[str, Any]], rl: Sequence[Mapping[str, Any]]
                       ) -> Figure:
  """An RL run's curves: the SFT warm start's loss over SFT steps, and per RL iteration the
  sampled reward / success, the policy loss, and entropy / clip fraction / KL.

  Args:
    sft: the run's {"event": "sft"} records ({"step", "loss"}).
    rl: its {"event": "rl"} records ({"iteration", "reward", "success", "loss", "entropy",
      "clip_fraction", "kl_ref", ...}; an iteration without a learner update has no loss).
  """
  fig = new_figure(11.0, 6.5)
  (a, b), (c, d) = fig.subplots(2, 2)
  _panel(a, sft, "step", [("loss", "SFT loss")], xlabel="SFT step",
         title="warm start (oracle demonstrations)")
  _panel(b, rl, "iteration", [("reward", "reward (sampled)"), ("success", "success (sampled)")],
         xlabel="RL iteration", title="rollouts")
  _panel(c, rl, "iteration", [("loss", "loss"), ("policy_loss", "policy loss")],
         xlabel="RL iteration", title="learner (mean over the iteration's updates)")
  _panel(d, rl, "iteration", [("entropy", "entropy (nats / token)"),
                              ("clip_fraction", "clip fraction"), ("kl_ref", "KL to reference")],
         xlabel="RL iteration", title="policy")
  return fig


def _colour(policy: str, policies: Sequence[str]) -> str:
  if policy in _POLICY_COLOURS:
    return _POLICY_COLOURS[policy]
  free = [f"C{i}" for i in range(10) if f"C{i}" not in _POLICY_COLOURS.values()]
  others = [p for p in policies if p not in _POLICY_COLOURS]
  return free[others.index(policy) % len(free)]


def agent_eval_bars(results: Mapping[str, Mapping[str, Any]]) -> Figure:
  """Success rate per level, one bar colour per policy, one panel per environment.

  Args:
    results: policy -> an rl.evaluate.evaluate_agent result: "cells" [{"env", "level",
      "success_rate", "episodes"}], "episodes".
  """
  policies = list(results)
  envs: list[str] = []
  for r in results.values():
    for c in r["cells"]:
      if c["env"] not in envs:
        envs.append(c["env"])
  if not envs:
    raise ValueError("agent_eval_bars: no cells in the results")
  levels = {e: sorted({c["level"] for r in results.values() for c in r["cells"]
                       if c["env"] == e}) for e in envs}
  width_in = max(5.0, sum(1.5 + 0.45 * len(policies) * len(levels[e]) for e in envs))
  fig = new_figure(width_in, 4.5)
  axes = fig.subplots(1, len(envs), squeeze=False, sharey=True)[0]
  width = 0.8 / len(policies)
  for ax, env in zip(axes, envs):
    x = np.arange(len(levels[env]))
    for k, policy in enumerate(policies):
      cell = {c["level"]: c for c in results[policy]["cells"] if c["env"] == env}
      rate = lambda c: np.nan if c.get("success_rate") is None else float(c["success_rate"])
      values = [rate(cell[lv]) if lv in cell else np.nan for lv in levels[env]]
      bars = ax.bar(x + (k - (len(policies) - 1) / 2) * width, values, width, label=policy,
                    color=_colour(policy, policies))
      ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(x)
    ax.set_xticklabels([str(lv) for lv in levels[env]])
    ax.set_xlim(-0.5, len(x) - 0.5)      # missing (NaN) bars must not stretch the axis
    ax.set_xlabel("level")
    ax.set_title(env, fontsize=10)
    ax.set_ylim(0, 1.12)
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_ylabel("success rate (reward = 1)")
  # Below the panels: inside, the legend would cover the bars at 1.0 (the oracle's).
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="outside lower center", ncol=len(policies), fontsize=8)
  n = {r.get("episodes") for r in results.values()}
  per_cell = f"{n.pop()} episodes per bar" if len(n) == 1 else "episodes per bar vary"
  fig.suptitle(f"Agent evaluation on held-out tasks ({per_cell})", fontsize=10)
  return fig
