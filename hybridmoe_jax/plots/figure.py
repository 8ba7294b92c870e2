"""Figures without pyplot: an Agg canvas per figure, PNG bytes, RGB arrays."""

from __future__ import annotations

import io
import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 100


def new_figure(width: float = 8.0, height: float = 4.5) -> Figure:
  """A figure (inches) drawn by its own Agg canvas: no pyplot state, no display needed."""
  fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def png_bytes(fig: Figure) -> bytes:
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=DPI)
  return buf.getvalue()


def save(fig: Figure, path: str) -> str:
  """Write `fig` as a PNG at `path` (atomically: a reader never sees half a file)."""
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    f.write(png_bytes(fig))
  os.replace(tmp, path)
  return path


def rgb_array(fig: Figure) -> np.ndarray:
  """The rendered figure as uint8 [H, W, 3] (for TensorBoard image summaries)."""
  canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
  canvas.draw()
  return np.asarray(canvas.buffer_rgba())[..., :3].copy()
