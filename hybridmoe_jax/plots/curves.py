"""Training loss, held-out loss and bits per byte over steps, with curriculum stages."""

from __future__ import annotations

from typing import Sequence

from matplotlib.figure import Figure

from hybridmoe_jax.plots import history
from hybridmoe_jax.plots.figure import new_figure


def _mark_events(ax, stages, resumes, label: bool) -> None:
  """Stage boundaries (grey dashed, "stage k T=n") and resumes (red dotted)."""
  for step, stage, seq_len in stages[1:]:
    ax.axvline(step, color="grey", ls="--", lw=1)
    if label:
      text = f"stage {stage}" + (f" T={seq_len}" if seq_len else "")
      ax.annotate(text, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                  va="top", ha="right", fontsize=8, color="dimgrey")
  for i, step in enumerate(resumes):
    ax.axvline(step, color="red", ls=":", lw=1, label="resume" if label and i == 0 else None)


def loss_figure(records: Sequence[history.Record]) -> Figure:
  """Train loss and held-out loss (top), held-out bits per byte (bottom) against step.

  Args:
    records: metrics.jsonl records; curriculum runs' train records carry "stage" and
      "seq_len" (the stage boundaries are drawn), resumes are {"event": "resume"}.
  """
  train = history.split_records(records, "train")
  evals = history.split_records(records, "eval")
  stages = history.stage_starts(train)
  resumes = history.event_steps(records, "resume")
  fig = new_figure(9.0, 6.0)
  top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
  steps, loss = history.series(train, "loss")
  top.plot(steps, loss, lw=1.2, label="train loss")
  e_steps, e_loss = history.series(evals, "loss")
  if len(e_steps):
    top.plot(e_steps, e_loss, "o-", ms=4, lw=1, label="held-out loss")
  top.set_ylabel("loss (nats / token)")
  top.set_title("Loss" + (f" over {len(stages)} curriculum stages" if len(stages) > 1 else ""))
  b_steps, bpb = history.series(evals, "bits_per_byte")
  if len(b_steps):
    bottom.plot(b_steps, bpb, "s-", ms=4, lw=1, color="C2", label="held-out bits / byte")
    bottom.legend(fontsize=8, loc="upper right")
  else:
    bottom.text(0.5, 0.5, "no held-out evaluation yet", ha="center", va="center",
                transform=bottom.transAxes)
  bottom.set_ylabel("bits per byte")
  bottom.set_xlabel("step")
  _mark_events(top, stages, resumes, label=True)
  _mark_events(bottom, stages, resumes, label=False)
  for ax in (top, bottom):
    ax.grid(alpha=0.3)
  if len(steps) or len(e_steps):
    top.legend(fontsize=8, loc="upper right")
  else:
    top.text(0.5, 0.5, "no training step logged yet", ha="center", va="center",
             transform=top.transAxes)
  return fig
