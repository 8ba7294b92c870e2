"""The figures' content: labels, ticks, titles, cell values, marks; drawn without pyplot."""

import ast
import pathlib

from matplotlib import image as mpimg
import numpy as np
import pytest

from hybridmoe_jax import plots
from hybridmoe_jax.plots import history, moe

PLOTS_DIR = pathlib.Path(plots.__file__).parent


def _texts(ax) -> list[str]:
  return [t.get_text() for t in ax.texts]


def test_expert_load_heatmap_content(tmp_path):
  load = np.array([[30, 10, 20, 20, 20, 20], [20, 20, 20, 20, 20, 20], [5, 5, 5, 5, 5, 35]])
  names = ["layers/1/ffn", "layers/2/ffn", "layers/10/ffn"]
  vio = [0.5, 0.0, 2.5]
  fig = plots.expert_load_figure(load, names, step=120, max_vio=vio, overload=1.4)
  ax, cbar = fig.axes                                  # the heatmap and its colour bar
  assert ax.get_xlabel() == "expert" and ax.get_ylabel() == "MoE layer"
  assert [t.get_text() for t in ax.get_xticklabels()] == [str(e) for e in range(6)]
  assert [t.get_text() for t in ax.get_yticklabels()] == ["layer 1", "layer 2", "layer 10"]
  assert "1 = balanced" in cbar.get_ylabel()
  title = ax.get_title()
  assert title.startswith("Expert load, step 120 only\nMaxVio at step 120: ")
  for label, v in zip(["layer 1", "layer 2", "layer 10"], vio):
    assert f"{label} {v:.3f}" in title
  # Cell colours are load / layer mean; the overloaded cells (> 1.4 x mean) carry an x.
  np.testing.assert_allclose(ax.images[0].get_array(), moe.relative_load(load))
  marks = np.asarray(ax.collections[0].get_offsets()).tolist()
  assert marks == [[0.0, 0.0], [5.0, 2.0]]              # (expert, layer)
  path = plots.save(fig, str(tmp_path / "h.png"))
  assert mpimg.imread(path).shape[2] in (3, 4)
  assert plots.rgb_array(fig).dtype == np.uint8


def test_expert_load_window_is_the_first_words_of_the_title():
  """The training heatmap (summed since the previous one) and the report's (one step) look
  alike: their titles say which steps they cover."""
  load = np.array([[1, 3], [2, 2]])
  summed = plots.expert_load_figure(load, ["a", "b"], step=20, first_step=11, max_vio=[1, 0])
  assert summed.axes[0].get_title().startswith(
      "Expert load, steps 11-20 (summed)\nMaxVio at step 20: a 1.000, b 0.000")
  computed = plots.expert_load_figure(load, ["a", "b"], step=20, first_step=11)
  assert "MaxVio of the summed load: a 0.500" in computed.axes[0].get_title()
  assert moe.window_label(20, 20) == "step 20 only"
  own = plots.expert_load_figure(load, ["a", "b"], step=20, window="the 3 logged steps 1-20")
  assert own.axes[0].get_title().startswith("Expert load, the 3 logged steps 1-20\n")


def test_expert_load_default_maxvio_and_idle_layer():
  fig = plots.expert_load_figure(np.array([[1, 3], [0, 0]]), ["a", "b"], step=1)
  title = fig.axes[0].get_title()
  assert "a 0.500" in title and "b 0.000" in title     # max / mean - 1; idle layer: 0
  assert not fig.axes[0].collections                     # nothing above 1.5 x mean
  with pytest.raises(ValueError, match="3 layer names"):
    plots.expert_load_figure(np.ones((2, 4)), ["a", "b", "c"], step=1)


def test_niah_grid_cells_are_the_accuracies():
  acc = [[1.0, 0.5, 0.0], [0.25, 0.75, 1.0]]
  result = {"lengths": [256, 512, 1024], "depths": [0.0, 1.0], "accuracy": acc,
            "samples": 4, "chance": 1e-5, "mean_accuracy": 0.583}
  ax = plots.niah_figure(result).axes[0]
  assert ax.get_xlabel() == "context length (tokens)" and "depth" in ax.get_ylabel()
  assert [t.get_text() for t in ax.get_xticklabels()] == ["256", "512", "1024"]
  assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1"]
  cells = {(round(t.get_position()[1]), round(t.get_position()[0])): float(t.get_text())
           for t in ax.texts}
  assert cells == {(i, j): acc[i][j] for i in range(2) for j in range(3)}
  assert "mean 0.58" in ax.get_title()
  with pytest.raises(ValueError, match="depths, lengths"):
    plots.niah_figure({**result, "accuracy": [[1.0, 0.5]]})


def test_vqa_bars_are_the_accuracies():
  per_type = {"count": {"questions": 10, "accuracy": 0.5, "blank_image_accuracy": 0.3,
                        "majority": 0.4, "chance": 0.25},
              "where": {"questions": 20, "accuracy": 0.3, "blank_image_accuracy": 0.1,
                        "majority": 0.2, "chance": 0.1}}
  ax = plots.vqa_figure({"per_type": per_type, "images": 5, "questions": 30}).axes[0]
  assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == ["count", "where"]
  heights = {c.get_label(): [b.get_height() for b in c] for c in ax.containers}
  assert heights == {"model": [0.5, 0.3], "same model, blank image": [0.3, 0.1],
                     "majority answer": [0.4, 0.2], "chance": [0.25, 0.1]}
  assert ax.get_ylabel() == "exact-match accuracy"


def _records():
  recs = [{"event": "start", "step": 0}]
  for step in range(10, 101, 10):
    recs.append({"step": step, "split": "train", "loss": 5.0 - step / 50,
                 "stage": 0 if step <= 40 else 1, "seq_len": 256 if step <= 40 else 1024,
                 "moe": {"layers/1/ffn": {"max_vio": 0.1 * step / 10, "bias_min": -0.1,
                                          "bias_max": 0.1, "load": [1, 2]},
                         "layers/3/ffn": {"max_vio": 0.2, "bias_min": -0.2,
                                          "bias_max": 0.3, "load": [2, 2]}}})
  recs.append({"event": "resume", "step": 60})
  recs.append({"step": 60, "split": "train", "loss": 1.0, "stage": 1, "seq_len": 1024})
  recs += [{"step": s, "split": "eval", "loss": 3.0, "bits_per_byte": 4.0} for s in (50, 100)]
  return recs


def test_loss_curves_with_stages_and_resume():
  fig = plots.loss_figure(_records())
  top, bottom = fig.axes
  labels = [line.get_label() for line in top.get_lines()]
  assert "train loss" in labels and "held-out loss" in labels and "resume" in labels
  train = next(line for line in top.get_lines() if line.get_label() == "train loss")
  assert len(train.get_xdata()) == 10
  assert train.get_ydata()[5] == 1.0                 # the redone step 60: the last record wins
  assert any(t.startswith("stage 1 T=1024") for t in _texts(top))
  assert bottom.get_xlabel() == "step" and bottom.get_ylabel() == "bits per byte"
  assert "2 curriculum stages" in top.get_title()


def test_maxvio_curves_per_layer_and_threshold():
  fig = plots.maxvio_figure(_records(), threshold=0.5)
  top, middle, bottom = fig.axes
  by_label = {line.get_label(): line for line in top.get_lines()}
  assert set(by_label) == {"layer 1", "layer 3", "alert threshold 0.5"}
  # Step 60 was redone after the resume and its last record holds no MoE stats: a gap.
  np.testing.assert_allclose(by_label["layer 1"].get_ydata(),
                             np.delete(0.1 * np.arange(1, 11), 5))
  # The bias: one spread line per layer (max - min, the MaxVio colours), no bands ...
  assert not middle.collections
  spread = {line.get_label(): line for line in middle.get_lines()}
  assert set(spread) == {"layer 1", "layer 3"}
  np.testing.assert_allclose(spread["layer 3"].get_ydata(), 0.5)
  assert spread["layer 3"].get_color() == by_label["layer 3"].get_color()
  # ... and each layer's [min, max] at its last logged step as one bar.
  bars = bottom.patches
  assert [(round(b.get_y(), 6), round(b.get_y() + b.get_height(), 6)) for b in bars] == [
      (-0.1, 0.1), (-0.2, 0.3)]
  assert [t.get_text() for t in bottom.get_xticklabels()] == ["layer 1", "layer 3"]
  assert bottom.get_title() == "routing bias [min, max] at step 100"
  empty = plots.maxvio_figure([])
  assert "no MoE statistics" in _texts(empty.axes[0])[0]
  assert "no routing-bias statistics" in _texts(empty.axes[2])[0]


def test_maxvio_many_layers_get_distinct_colours():
  recs = [{"step": s, "split": "train",
           "moe": {f"layers/{i}/ffn": {"max_vio": 0.1, "bias_min": -0.01 * i,
                                       "bias_max": 0.01 * i} for i in range(1, 25)}}
          for s in (1, 10)]
  fig = plots.maxvio_figure(recs)
  colours = {tuple(np.atleast_1d(line.get_color())) for line in fig.axes[0].get_lines()}
  assert len(colours) == 24
  assert len(fig.axes[2].patches) == 24


def test_history_helpers():
  recs = _records()
  train = history.split_records(recs, "train")
  assert [r["step"] for r in train] == list(range(10, 101, 10))
  assert history.stage_starts(train) == [(10, 0, 256), (50, 1, 1024)]
  assert history.event_steps(recs, "resume") == [60]
  assert history.layer_names(train) == ["layers/1/ffn", "layers/3/ffn"]
  assert history.series([{"step": 1, "x": "nan"}, {"step": 2, "x": 3}], "x")[0].tolist() == [2]


def test_plots_use_no_pyplot_and_only_numpy_matplotlib():
  """Figures come from matplotlib.figure.Figure + an Agg canvas: no global pyplot state."""
  allowed = {"numpy", "matplotlib", "hybridmoe_jax", "__future__", "typing", "io", "os", "re"}
  for path in PLOTS_DIR.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
      for name in names:
        assert name.split(".")[0] in allowed, (path.name, name)
        assert "pyplot" not in name, (path.name, name)


def test_success_by_level_lines_and_gaps():
  series = {"arithmetic/L0": [0.25, 0.5, None, 1.0], "arithmetic/L1": [None, None, 0.0, 0.5]}
  fig = plots.success_by_level([10, 20, 30, 40], series, title="RL success")
  ax = fig.axes[0]
  lines = {line.get_label(): line for line in ax.get_lines()}
  assert set(lines) == set(series)
  np.testing.assert_array_equal(lines["arithmetic/L0"].get_xdata(), [10, 20, 30, 40])
  np.testing.assert_array_equal(lines["arithmetic/L0"].get_ydata(), [0.25, 0.5, np.nan, 1.0])
  assert np.isnan(lines["arithmetic/L1"].get_ydata()[:2]).all()   # not evaluated: a gap
  assert ax.get_title() == "RL success" and ax.get_xlabel() == "step"
  assert "success" in ax.get_ylabel() and ax.get_ylim()[1] > 1.0
  with pytest.raises(ValueError, match="'arithmetic/L1' has 2 values; steps has 4"):
    plots.success_by_level([10, 20, 30, 40], {"arithmetic/L1": [0.0, 1.0]}, title="x")
  assert "no evaluation yet" in _texts(plots.success_by_level([], {}, title="x").axes[0])


def test_agent_eval_bars_one_colour_per_policy():
  def result(rates, episodes=4):
    return {"episodes": episodes, "cells": [
        {"env": env, "level": lv, "success_rate": r, "episodes": episodes}
        for (env, lv), r in rates.items()]}
  results = {"model": result({("arithmetic", 0): 0.5, ("arithmetic", 2): 0.25,
                              ("retrieval", 1): 0.75}),
             "oracle": result({("arithmetic", 0): 1.0, ("arithmetic", 2): 1.0,
                               ("retrieval", 1): 1.0}),
             "random": result({("arithmetic", 0): 0.0, ("arithmetic", 2): 0.0,
                               ("retrieval", 1): 0.0})}
  fig = plots.agent_eval_bars(results)
  arith, retr = fig.axes
  assert (arith.get_title(), retr.get_title()) == ("arithmetic", "retrieval")
  assert [t.get_text() for t in arith.get_xticklabels()] == ["0", "2"]
  assert arith.get_xlabel() == "level" and "success" in arith.get_ylabel()
  heights = {c.get_label(): [b.get_height() for b in c] for c in arith.containers}
  assert heights == {"model": [0.5, 0.25], "oracle": [1.0, 1.0], "random": [0.0, 0.0]}
  colours = {c.get_label(): c[0].get_facecolor() for c in retr.containers}
  assert len(set(colours.values())) == 3
  assert [b.get_height() for b in retr.containers[0]] == [0.75]
  assert "4 episodes per bar" in fig._suptitle.get_text()   # pylint: disable=protected-access
  with pytest.raises(ValueError, match="no cells"):
    plots.agent_eval_bars({"model": {"cells": []}})


def test_agent_eval_bars_leave_a_not_evaluated_cell_empty():
  """Success rates of None (not evaluated, as the module says of its inputs) draw no bar,
  like NaN; float(None) raised."""
  results = {"model": {"episodes": 4, "cells": [
      {"env": "arithmetic", "level": 0, "success_rate": None, "episodes": 0},
      {"env": "arithmetic", "level": 1, "success_rate": 0.5, "episodes": 4}]}}
  ax = plots.agent_eval_bars(results).axes[0]
  heights = [b.get_height() for b in ax.containers[0]]
  assert np.isnan(heights[0]) and heights[1] == 0.5
