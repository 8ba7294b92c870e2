"""What the RL run reports beyond its metric records (`train.monitor.Monitor.record`: one
flat {"event": "sft" | "rl" | "eval", "step": checkpoint step (SFT steps, then sft_steps +
iteration), "iteration", name: number} line in metrics.jsonl, TensorBoard `<event>/<name>`):

* `progress_line(metrics, total, sft_steps)`: an iteration's log line: reward, success, the
  learner's loss / entropy / clip fraction / KL (or why there was no update), and, when no
  sampled episode succeeded, that fact and its likely causes;
* `success_figure(workdir, history)`: success_by_level.png over RL iterations.
"""

from __future__ import annotations

import os
from typing import Any

from hybridmoe_jax import plots


def progress_line(m: dict[str, Any], total: int, *, sft_steps: int) -> str:
  """One iteration's log line from its metrics (rl/trainer.py's iteration() dict)."""
  parts = [f"iter {m['iteration']}/{total}"]
  for k, fmt in (("reward", "{:.3f}"), ("success", "{:.2f}"), ("loss", "{:+.4f}"),
                 ("entropy", "{:.3f}"), ("clip_fraction", "{:.3f}"), ("kl_ref", "{:.4f}"),
                 ("generated_tokens", "{:.0f}"), ("rollout_s", "{:.1f}s"),
                 ("learner_s", "{:.1f}s")):
    if k in m:
      parts.append(f"{k} " + fmt.format(m[k]))
  trained, dropped = m.get("groups_trained", 0), m.get("groups_dropped", 0)
  if not m.get("updates"):
    parts.append("no update: " + (
        f"all {dropped} finished groups had equal rewards (no signal; dropped)" if dropped
        else "no group finished yet" if not m.get("episodes") else "no complete group"))
  else:
    parts.append(f"{m['updates']} updates on {trained} groups ({dropped} dropped)")
  fr = ",".join(f"{k.split('/')[1]}:{v}" for k, v in m.items() if k.startswith("frontier/"))
  parts.append(f"frontier {fr}")
  if m.get("episodes") and m.get("success", 0.0) == 0.0:
    parts.append(f"NO EPISODE SUCCEEDED (reward 0 everywhere: nothing to learn from): warm "
                 f"start too short? (rl.sft_steps = {sft_steps}; configs/rl_tiny.py uses 600 "
                 "and still fails at ~300 on some seeds) or the frontier level too hard for "
                 "this model (rl.envs.<env>.start_level)")
  return " | ".join(parts)


def success_figure(workdir: str, history: list[dict]) -> str | None:
  """success_by_level.png from the eval history [{"iteration", "success": {cell: x}}]."""
  if not history:
    return None
  steps = [h["iteration"] for h in history]
  cells = sorted({c for h in history for c in h["success"]})
  series = {c: [h["success"].get(c) for h in history] for c in cells}
  fig = plots.success_by_level(steps, series, title="held-out success by level (greedy)",
                               xlabel="RL iteration")
  return plots.save(fig, os.path.join(workdir, "success_by_level.png"))
