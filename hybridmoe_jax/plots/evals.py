"""Eval results as figures: NIAH accuracy over length x depth, RULER-style recall over task x
length, VQA per question type."""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure

from hybridmoe_jax.plots.figure import new_figure

# VQA bars: (result key, legend label, colour).
_VQA_BARS = (("accuracy", "model", "C0"), ("blank_image_accuracy", "same model, blank image",
                                            "C7"),
             ("majority", "majority answer", "C1"), ("chance", "chance", "C3"))


def _unit_grid(values: np.ndarray, cells: list[list[str]], rows: list[str], cols: list[str],
               size: tuple[float, float], label: str, fontsize: int):
  """(figure, axes) of a [rows, cols] grid of values in [0, 1] (red -> green), `cells` text
  written in each cell, columns = context lengths."""
  fig = new_figure(*size)
  ax = fig.add_subplot()
  image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto",
                    interpolation="nearest")
  fig.colorbar(image, ax=ax, label=label)
  for i in range(len(rows)):
    for j in range(len(cols)):
      ax.text(j, i, cells[i][j], ha="center", va="center", fontsize=fontsize,
              color="black" if 0.25 < values[i, j] < 0.85 else "white")
  ax.set_xticks(np.arange(len(cols)))
  ax.set_xticklabels(cols)
  ax.set_yticks(np.arange(len(rows)))
  ax.set_yticklabels(rows)
  ax.set_xlabel("context length (tokens)")
  return fig, ax


def niah_figure(result: dict[str, Any]) -> Figure:
  """Passkey accuracy per (needle depth, context length) cell, the value written in it.

  Args:
    result: `evals.niah.evaluate_niah`'s result: "lengths" [N], "depths" [D], "accuracy"
      [D][N] in [0, 1], "samples", "chance", "mean_accuracy".
  """
  acc = np.asarray(result["accuracy"], np.float64)
  lengths, depths = list(result["lengths"]), list(result["depths"])
  if acc.shape != (len(depths), len(lengths)):
    raise ValueError(f"niah accuracy has shape {acc.shape}; expected [depths, lengths] = "
                     f"{[len(depths), len(lengths)]}")
  fig, ax = _unit_grid(acc, [[f"{a:.2f}" for a in row] for row in acc],
                       [f"{d:g}" for d in depths], [str(n) for n in lengths],
                       (max(5.0, 2.5 + 1.1 * len(lengths)), max(3.5, 1.8 + 0.6 * len(depths))),
                       "exact-match accuracy", 10)
  ax.set_ylabel("needle depth (0 = start, 1 = end)")
  ax.set_title(f"Passkey retrieval (NIAH): mean {float(acc.mean()):.2f}, "
               f"{result.get('samples', '?')} per cell, chance {result.get('chance', 0):.0e}",
               fontsize=10)
  return fig


def vqa_figure(result: dict[str, Any]) -> Figure:
  """Accuracy per question type next to the blank-image, majority and chance baselines.

  Args:
    result: `evals.vqa.evaluate_vqa`'s result: "per_type" {type: {"questions", "accuracy",
      "blank_image_accuracy", "majority", "chance"}}, "images", "questions".
  """
  types = list(result["per_type"])
  fig = new_figure(max(6.0, 2.0 + 2.0 * len(types)), 4.5)
  ax = fig.add_subplot()
  width = 0.8 / len(_VQA_BARS)
  x = np.arange(len(types))
  for k, (key, label, colour) in enumerate(_VQA_BARS):
    values = [float(result["per_type"][t][key]) for t in types]
    bars = ax.bar(x + (k - (len(_VQA_BARS) - 1) / 2) * width, values, width, label=label,
                  color=colour)
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
  ax.set_xticks(x)
  ax.set_xticklabels([f"{t}\n({result['per_type'][t]['questions']} q.)" for t in types])
  ax.set_ylim(0, 1.1)
  ax.set_ylabel("exact-match accuracy")
  ax.set_xlabel("question type")
  ax.set_title(f"VQA on {result.get('images', '?')} held-out images "
               f"({result.get('questions', '?')} questions): model vs baselines", fontsize=10)
  ax.legend(fontsize=8, loc="upper right", ncol=2)
  ax.grid(axis="y", alpha=0.3)
  return fig


def ruler_figure(result: dict[str, Any]) -> Figure:
  """RULER-style recall per (task, context length) cell, the score and the 95% Wilson
  interval of the all-correct rate written in it.

  Args:
    result: `evals.ruler.evaluate_ruler`'s result: "tasks" [T], "lengths" [L], "score",
      "wilson_low", "wilson_high" [T][L] in [0, 1], "samples", "split".
  """
  score = np.asarray(result["score"], np.float64)
  tasks, lengths = list(result["tasks"]), list(result["lengths"])
  if score.shape != (len(tasks), len(lengths)):
    raise ValueError(f"ruler score has shape {score.shape}; expected [tasks, lengths] = "
                     f"{[len(tasks), len(lengths)]}")
  lo, hi = (np.asarray(result[k], np.float64) for k in ("wilson_low", "wilson_high"))
  cells = [[f"{score[i, j]:.2f}\n[{lo[i, j]:.2f}, {hi[i, j]:.2f}]" for j in range(len(lengths))]
           for i in range(len(tasks))]
  fig, ax = _unit_grid(score, cells, tasks, [str(n) for n in lengths],
                       (max(5.5, 3.0 + 1.3 * len(lengths)), max(3.5, 1.5 + 0.55 * len(tasks))),
                       "recall (RULER string match)", 7)
  ax.set_title(f"RULER-style, {result.get('split', '?')} split, {result.get('samples', '?')} "
               "prompts/cell [95% Wilson, all correct]", fontsize=9)
  return fig
