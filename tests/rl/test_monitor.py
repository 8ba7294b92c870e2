"""RL monitoring: the progress line (learner metrics, why there was no update, the
zero-success notice) and the figures' x axes (RL iterations, not steps)."""

import json

from hybridmoe_jax import plots
from hybridmoe_jax.config.run import TrainConfig
from hybridmoe_jax.rl.progress import progress_line, success_figure
from hybridmoe_jax.train.monitor import Event, Monitor

BASE = {"iteration": 3, "episodes": 64, "frontier/arithmetic": 1, "rollout_s": 2.0}


def test_progress_line_of_an_update_shows_the_learner():
  m = dict(BASE, reward=0.25, success=0.25, loss=-0.0123, entropy=0.31, clip_fraction=0.02,
           updates=2, groups_trained=5, groups_dropped=3, learner_s=1.5)
  line = progress_line(m, 8, sft_steps=600)
  for part in ("iter 3/8", "reward 0.250", "loss -0.0123", "entropy 0.310",
               "clip_fraction 0.020", "2 updates on 5 groups (3 dropped)",
               "frontier arithmetic:1"):
    assert part in line, (part, line)
  assert "NO EPISODE SUCCEEDED" not in line


def test_a_zero_reward_iteration_says_so_and_why():
  m = dict(BASE, reward=0.0, success=0.0, groups_trained=0, groups_dropped=8)
  line = progress_line(m, 8, sft_steps=100)
  assert "reward 0.000" in line
  assert "no update: all 8 finished groups had equal rewards" in line
  assert "NO EPISODE SUCCEEDED" in line and "warm start too short? (rl.sft_steps = 100" in line
  assert "\n" not in line
  waiting = progress_line(dict(BASE, episodes=0), 8, sft_steps=600)
  assert "no update: no group finished yet" in waiting and "SUCCEEDED" not in waiting


def test_success_figure_counts_iterations(tmp_path):
  mon = Monitor(str(tmp_path), TrainConfig())
  try:
    mon.record(Event.RL, 101, dict(BASE, success=0.0), line=progress_line(
        dict(BASE, success=0.0), 8, sft_steps=0))
    path = success_figure(str(tmp_path), [{"iteration": 0, "success": {"arithmetic/L3": 0.1}},
                               {"iteration": 10, "success": {"arithmetic/L3": 0.3}}])
  finally:
    mon.close()
  assert path.endswith("success_by_level.png")
  rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert rec["event"] == "rl" and rec["step"] == 101 and rec["iteration"] == 3
  fig = plots.success_by_level([0, 10], {"a": [0.1, 0.3]}, xlabel="RL iteration")
  assert fig.axes[0].get_xlabel() == "RL iteration"


def test_rl_training_figure_axes():
  sft = [{"event": "sft", "step": s, "loss": 1.0 / s} for s in (50, 100)]
  rl = [{"event": "rl", "step": 100 + i, "iteration": i, "reward": 0.1 * i, "success": 0.1 * i,
         **({"loss": -0.01, "entropy": 0.2} if i > 1 else {})} for i in (1, 2, 3)]
  fig = plots.rl_training_figure(sft, rl)
  a, b, c, d = fig.axes[:4]
  assert a.get_xlabel() == "SFT step" and [ax.get_xlabel() for ax in (b, c, d)] == [
      "RL iteration"] * 3
  assert list(c.get_lines()[0].get_xdata()) == [2.0, 3.0]   # no update at iteration 1
  assert {ln.get_label() for ln in b.get_lines()} == {"reward (sampled)", "success (sampled)"}
  empty = plots.rl_training_figure([], [])
  assert any(t.get_text() == "not logged" for t in empty.axes[0].texts)
