"""Expert load per layer x expert, and MaxVio / routing-bias ranges over the steps."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from hybridmoe_jax.plots import history
from hybridmoe_jax.plots.figure import new_figure

_PER_TITLE_LINE = 4   # MaxVio entries per title line


def relative_load(load: np.ndarray) -> np.ndarray:
  """load [L, E] -> load / mean load of its layer (1 = balanced; an idle layer stays 0)."""
  load = np.asarray(load, np.float64)
  return load / np.maximum(load.mean(axis=1, keepdims=True), 1e-9)


def _maxvio_title(labels: Sequence[str], max_vio: Sequence[float]) -> str:
  items = [f"{lab} {v:.3f}" for lab, v in zip(labels, max_vio)]
  lines = [", ".join(items[i:i + _PER_TITLE_LINE]) for i in range(0, len(items), _PER_TITLE_LINE)]
  return "MaxVio: " + "\n".join(lines)


def expert_load_figure(load: np.ndarray, layers: Sequence[str], *, step: int,
                       max_vio: Sequence[float] | None = None, overload: float = 1.5,
                       window: str = "") -> Figure:
  """Heatmap of each MoE layer's load per expert, relative to the layer's mean.

  Args:
    load: [L, E] tokens routed to each expert (counts, any scale) of L MoE layers.
    layers: L layer names (e.g. "layers/1/ffn"); shown as "layer 1".
    step: the training step the load belongs to (shown in the title).
    max_vio: [L] MaxVio per layer for the title (the metric the alerts use); default: the
      MaxVio of `load` itself, max_e load / mean - 1.
    overload: cells with load / mean above this are marked with a red x.
    window: text after the step, e.g. "load summed over steps 51-100".

  Returns:
    The figure: x = expert index, y = layer, colour = load / mean (colour bar), title with
    the step and the MaxVio of every layer.
  """
  rel = relative_load(load)
  num_layers, num_experts = rel.shape
  if len(layers) != num_layers:
    raise ValueError(f"{len(layers)} layer names for a load of {num_layers} layers")
  if max_vio is None:
    max_vio = (rel.max(axis=1) - 1.0).clip(min=0.0)
  labels = [history.layer_label(n) for n in layers]
  fig = new_figure(max(6.0, min(16.0, 2.5 + 0.35 * num_experts)),
                   max(3.0, min(14.0, 2.2 + 0.45 * num_layers)))
  ax = fig.add_subplot()
  image = ax.imshow(rel, cmap="viridis", vmin=0.0, vmax=max(2.0, float(rel.max())),
                    aspect="auto", interpolation="nearest")
  fig.colorbar(image, ax=ax, label="load / layer mean (1 = balanced)")
  if num_experts <= 64:
    ax.set_xticks(np.arange(num_experts))
    ax.set_xticklabels([str(e) for e in range(num_experts)],
                       fontsize=8 if num_experts <= 32 else 5)
  ax.set_yticks(np.arange(num_layers))
  ax.set_yticklabels(labels)
  ax.set_xlabel("expert")
  ax.set_ylabel("MoE layer")
  rows, cols = np.nonzero(rel > overload)
  if len(rows):
    ax.scatter(cols, rows, marker="x", color="red", s=60, linewidths=2,
               label=f"overloaded (> {overload:g} x mean)")
    ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
  head = f"Expert load at step {step}" + (f" ({window})" if window else "")
  ax.set_title(head + "\n" + _maxvio_title(labels, max_vio), fontsize=10)
  return fig


def maxvio_figure(records: Sequence[history.Record], *, threshold: float | None = None
                  ) -> Figure:
  """MaxVio per MoE layer (top) and its routing-bias range [min, max] (bottom) over steps.

  Args:
    records: metrics.jsonl records (train records carry "moe").
    threshold: the MaxVio alert threshold, drawn as a dashed line.
  """
  train = history.split_records(records, "train")
  names = history.layer_names(train)
  fig = new_figure(9.0, 6.5)
  top, bottom = fig.subplots(2, 1, sharex=True)
  colours = [f"C{i % 10}" for i in range(len(names))]
  for name, c in zip(names, colours):
    steps, vio = history.moe_series(train, name, "max_vio")
    top.plot(steps, vio, color=c, label=history.layer_label(name), lw=1.2)
    s_lo, lo = history.moe_series(train, name, "bias_min")
    s_hi, hi = history.moe_series(train, name, "bias_max")
    if len(lo) and len(lo) == len(hi):
      bottom.fill_between(s_lo, lo, hi, color=c, alpha=0.2)
      bottom.plot(s_lo, lo, color=c, lw=0.8)
      bottom.plot(s_hi, hi, color=c, lw=0.8, label=history.layer_label(name))
  if threshold is not None:
    top.axhline(threshold, color="red", ls="--", lw=1, label=f"alert threshold {threshold:g}")
  top.set_ylabel("MaxVio (max load / mean - 1)")
  top.set_title("Load balance per MoE layer")
  bottom.set_ylabel("routing bias [min, max]")
  bottom.set_xlabel("step")
  for ax in (top, bottom):
    ax.grid(alpha=0.3)
  if names:
    top.legend(fontsize=8, ncol=min(4, len(names) + 1), loc="upper right")
  else:
    top.text(0.5, 0.5, "no MoE statistics logged yet", ha="center", transform=top.transAxes)
  return fig
