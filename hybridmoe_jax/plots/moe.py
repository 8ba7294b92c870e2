"""Expert load per layer x expert (labelled with the steps it covers), and MaxVio /
routing-bias spread and range per MoE layer over the steps."""

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


def _maxvio_title(labels: Sequence[str], max_vio: Sequence[float], of: str) -> str:
  items = [f"{lab} {v:.3f}" for lab, v in zip(labels, max_vio)]
  lines = [", ".join(items[i:i + _PER_TITLE_LINE]) for i in range(0, len(items), _PER_TITLE_LINE)]
  return f"MaxVio {of}: " + "\n".join(lines)


def window_label(first_step: int, step: int) -> str:
  """The steps an expert-load figure sums: "step 20 only" or "steps 11-20 (summed)"."""
  return f"step {step} only" if first_step >= step else f"steps {first_step}-{step} (summed)"


def expert_load_figure(load: np.ndarray, layers: Sequence[str], *, step: int,
                       first_step: int | None = None, max_vio: Sequence[float] | None = None,
                       overload: float = 1.5, window: str | None = None) -> Figure:
  """Heatmap of each MoE layer's load per expert, relative to the layer's mean.

  Args:
    load: [L, E] tokens routed to each expert (counts, any scale) of L MoE layers, summed
      over steps first_step..step.
    layers: L layer names (e.g. "layers/1/ffn"); shown as "layer 1".
    step: the last training step the load covers.
    first_step: the first one (default `step`: the load of one step). The window is the
      title's first words ("steps 11-20 (summed)" / "step 20 only", `window_label`): the
      training heatmaps sum since the previous heatmap, the run report shows one step.
    max_vio: [L] MaxVio per layer for the title (the metric the alerts use, of `step`);
      default: the MaxVio of `load` itself, max_e load / mean - 1.
    overload: cells with load / mean above this are marked with a red x.
    window: the title's words for the steps `load` covers, in place of `window_label`'s
      (e.g. "the 31 logged steps 1-300 (summed)" for a sum over logged steps only).

  Returns:
    The figure: x = expert index, y = layer, colour = load / mean (colour bar), title with
    the window and the MaxVio of every layer.
  """
  first_step = step if first_step is None else first_step
  rel = relative_load(load)
  num_layers, num_experts = rel.shape
  if len(layers) != num_layers:
    raise ValueError(f"{len(layers)} layer names for a load of {num_layers} layers")
  max_vio_given = max_vio is not None
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
  window = window or window_label(first_step, step)
  # Given MaxVio values are the step's (the alerts' metric); computed ones, the window's.
  vio_of = (f"at step {step}" if max_vio_given or first_step >= step
            else "of the summed load")
  ax.set_title(f"Expert load, {window}\n" + _maxvio_title(labels, max_vio, vio_of),
               fontsize=10)
  return fig


def _layer_colours(n: int) -> list:
  """Distinct colours for up to 10 layers; beyond, a depth ramp (viridis)."""
  if n <= 10:
    return [f"C{i}" for i in range(n)]
  from matplotlib import colormaps  # pylint: disable=import-outside-toplevel
  return [colormaps["viridis"](i / max(n - 1, 1)) for i in range(n)]


def maxvio_figure(records: Sequence[history.Record], *, threshold: float | None = None,
                  alert_steps: int | None = None) -> Figure:
  """MaxVio per MoE layer, its routing-bias spread over steps and its bias range now.

  Panels: MaxVio per layer over steps (top); the spread max - min of each layer's routing
  bias over steps (middle: one line per layer, the same colours; overlapping min / max bands
  of many layers are unreadable); each layer's [min, max] bias at the last logged step as a
  vertical bar (bottom: the offsets the spread leaves out).

  Args:
    records: metrics.jsonl records (train records carry "moe").
    threshold: the MaxVio alert threshold, drawn as a dashed line.
    alert_steps: the steps in a row above it that raise an alert (said in the line's label,
      so a line crossed for fewer steps is not read as a missed alert).
  """
  train = history.split_records(records, "train")
  names = history.layer_names(train)
  fig = new_figure(9.0, 8.5)
  grid = fig.add_gridspec(3, 1, height_ratios=(2.2, 1.6, 1.4))
  top = fig.add_subplot(grid[0])
  middle = fig.add_subplot(grid[1], sharex=top)
  bottom = fig.add_subplot(grid[2])
  colours = _layer_colours(len(names))
  last = []   # (label, colour, step, min, max) at each layer's last logged bias
  for name, c in zip(names, colours):
    label = history.layer_label(name)
    steps, vio = history.moe_series(train, name, "max_vio")
    top.plot(steps, vio, color=c, label=label, lw=1.2)
    s_lo, lo = history.moe_series(train, name, "bias_min")
    s_hi, hi = history.moe_series(train, name, "bias_max")
    if len(lo) and np.array_equal(s_lo, s_hi):
      middle.plot(s_lo, hi - lo, color=c, lw=1.2, label=label)
      last.append((label, c, int(s_lo[-1]), float(lo[-1]), float(hi[-1])))
  if threshold is not None:
    rule = f" (alert: {alert_steps} steps in a row above)" if alert_steps else ""
    top.axhline(threshold, color="red", ls="--", lw=1,
                label=f"alert threshold {threshold:g}{rule}")
  top.set_ylabel("MaxVio\n(max load / mean - 1)")
  top.set_title("Load balance per MoE layer")
  middle.set_ylabel("bias spread\n(max - min)")
  middle.set_xlabel("step")
  for ax in (top, middle, bottom):
    ax.grid(alpha=0.3)
  if last:
    x = np.arange(len(last))
    bottom.bar(x, [hi - lo for *_, lo, hi in last], bottom=[lo for *_, lo, _ in last],
               width=0.5, color=[c for _, c, *_ in last])
    bottom.axhline(0.0, color="grey", lw=0.8)
    bottom.set_xticks(x)
    bottom.set_xticklabels([lab for lab, *_ in last], fontsize=8 if len(last) <= 16 else 6,
                           rotation=0 if len(last) <= 12 else 90)
    steps_now = sorted({st for _, _, st, _, _ in last})
    at = f"step {steps_now[-1]}" if len(steps_now) == 1 else "each layer's last logged step"
    bottom.set_title(f"routing bias [min, max] at {at}", fontsize=9)
    bottom.set_ylabel("bias")
    bottom.set_xlim(-0.6, len(last) - 0.4)
  else:
    bottom.text(0.5, 0.5, "no routing-bias statistics logged yet", ha="center",
                va="center", transform=bottom.transAxes)
  if names:
    ncol = min(5, len(names) + 1)
    top.legend(fontsize=7 if len(names) > 10 else 8, ncol=ncol, loc="upper right")
  else:
    top.text(0.5, 0.5, "no MoE statistics logged yet", ha="center", transform=top.transAxes)
  return fig
