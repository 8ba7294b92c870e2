"""What the CLIs print: clean log lines, a progress bar on a terminal, no TPU probe on CPU.

Imports neither jax nor our other modules, so a CLI may call `skip_absent_tpu` before any
jax backend starts.

* `CleanLogHandler` replaces absl's handler: "step 10/20 | loss ..." instead of
  "I1204 13:37:29.844782 140660088568704 monitor.py:164] step 10/20 | loss ...";
  warnings and logged errors keep a "warning:" / "ERROR:" prefix. absl's verbosity flags still
  decide which records arrive.
* `ProgressBar`: one line redrawn in place on a terminal (log lines scroll above it);
  nothing on a pipe or file, where the periodic log lines are the progress.
* `skip_absent_tpu`: with libtpu installed, jax probes for a TPU on every start and libtpu
  prints several lines of noise when there is none. On a machine with no TPU and no GPU
  (and JAX_PLATFORMS not set by the user) this sets JAX_PLATFORMS=cpu, so the probe never
  runs; anything that may be a TPU host keeps jax's own choice.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import time
from typing import TextIO

# PCI device ids of Google TPUs (vendor 0x1ae0; the same vendor also makes the gVNIC and
# NVMe devices of ordinary cloud VMs, so the vendor alone does not mean a TPU).
_GOOGLE_VENDOR = "0x1ae0"
_TPU_DEVICE_IDS = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
# Set by jax's own import on any machine with libtpu installed (the first one when it found
# no TPU chip): no sign of a TPU.
_NOT_TPU_HINTS = ("TPU_SKIP_MDS_QUERY", "TPU_LIBRARY_PATH")
_GPU_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def _read(path: str) -> str:
  try:
    with open(path, encoding="ascii") as f:
      return f.read().strip()
  except OSError:
    return ""


def tpu_may_be_present(root: str = "/") -> bool:
  """True unless this machine surely has no TPU: none of the TPU device nodes (/dev/accel*,
  /dev/vfio/<n>), no TPU PCI device, no TPU_* (but those jax sets anywhere) or
  JAX_FORCE_TPU_INIT in the environment."""
  if any((k.startswith("TPU_") and k not in _NOT_TPU_HINTS) or k == "JAX_FORCE_TPU_INIT"
         for k in os.environ):
    return True
  dev = os.path.join(root, "dev")
  if glob.glob(os.path.join(dev, "accel*")) or glob.glob(os.path.join(dev, "vfio", "[0-9]*")):
    return True
  for vendor in glob.glob(os.path.join(root, "sys", "bus", "pci", "devices", "*", "vendor")):
    if _read(vendor) == _GOOGLE_VENDOR and _read(
        os.path.join(os.path.dirname(vendor), "device")) in _TPU_DEVICE_IDS:
      return True
  return False


def skip_absent_tpu(root: str = "/") -> str | None:
  """Set JAX_PLATFORMS=cpu where there is surely no accelerator; -> "cpu" or None (unset).

  Does nothing when the user set JAX_PLATFORMS (even to ""), when a TPU may be present or a
  GPU device node exists. Call before any jax backend starts (a later call has no effect
  in this process); jax may already be imported.
  """
  jax = sys.modules.get("jax")
  if "JAX_PLATFORMS" in os.environ or tpu_may_be_present(root) or (
      jax is not None and jax.config.jax_platforms):   # chosen: by the user or jax's TPU init
    return None
  if any(os.path.exists(os.path.join(root, p.lstrip("/"))) for p in _GPU_NODES):
    return None
  os.environ["JAX_PLATFORMS"] = "cpu"
  if jax is not None:   # its config read the environment at import
    jax.config.update("jax_platforms", "cpu")
  return "cpu"


def fmt_duration(seconds: float) -> str:
  """'1h02m', '3m05s', '7s'; '?' for an unknown (non-finite) time."""
  if not seconds == seconds or seconds in (float("inf"), float("-inf")):
    return "?"
  seconds = int(round(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class ProgressBar:
  """A one-line bar, redrawn in place: `  35% |#######.............| 7/20 loss 4.13 ...`.

  Only draws on a terminal (`stream.isatty()`); elsewhere every call is a no-op. Redraws
  at most every `min_interval` seconds (and always at the last step).
  """

  def __init__(self, stream: TextIO | None = None, *, width: int = 24,
               min_interval: float = 0.1):
    self.stream = stream or sys.stderr
    self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
    self.width, self.min_interval = width, min_interval
    self._line = ""
    self._drawn_at = 0.0

  def render(self, step: int, total: int, text: str = "") -> str:
    frac = min(max(step / total, 0.0), 1.0) if total > 0 else 1.0
    filled = int(round(frac * self.width))
    bar = "#" * filled + "." * (self.width - filled)
    return f"{frac:4.0%} |{bar}| {step}/{total}" + (f" {text}" if text else "")

  def update(self, step: int, total: int, text: str = "") -> None:
    if not self.enabled:
      return
    now = time.monotonic()
    if step < total and now - self._drawn_at < self.min_interval:
      return
    self._drawn_at = now
    self._line = self.render(step, total, text)
    self._draw()

  def _draw(self) -> None:
    cols = _columns(self.stream)
    self.stream.write("\r\x1b[K" + self._line[:cols - 1])
    self.stream.flush()

  def clear(self) -> None:
    """Erase the bar (before a log line is written); `redraw` puts it back."""
    if self.enabled and self._line:
      self.stream.write("\r\x1b[K")

  def redraw(self) -> None:
    if self.enabled and self._line:
      self._draw()

  def close(self) -> None:
    """Leave the last drawn bar on its own line."""
    if self.enabled and self._line:
      self.stream.write("\n")
      self.stream.flush()
    self._line = ""


def _columns(stream: TextIO) -> int:
  try:
    return os.get_terminal_size(stream.fileno()).columns
  except (OSError, AttributeError, ValueError):
    return 100


# The bar the Monitor draws into; set by a CLI (`install`), None in library use and tests.
_BAR: ProgressBar | None = None


def active_bar() -> ProgressBar | None:
  return _BAR


class CleanFormatter(logging.Formatter):
  """The message alone; "warning: " / "ERROR: " before records at those levels (a logged
  error goes on; the CLIs' fatal one-line "error: ..." stays the only lowercase one)."""

  def format(self, record: logging.LogRecord) -> str:
    msg = super().format(record)
    if record.levelno >= logging.ERROR:
      return f"ERROR: {msg}"
    if record.levelno >= logging.WARNING:
      return f"warning: {msg}"
    return msg


class CleanLogHandler(logging.StreamHandler):
  """Writes clean lines to `stream`, clearing and redrawing the progress bar around them."""

  def __init__(self, stream: TextIO | None = None):
    super().__init__(stream or sys.stderr)
    self.setFormatter(CleanFormatter("%(message)s"))

  def emit(self, record: logging.LogRecord) -> None:
    bar = _BAR
    if bar is not None:
      bar.clear()
    super().emit(record)
    if bar is not None:
      bar.redraw()


def install(stream: TextIO | None = None, *, bar: bool = True) -> CleanLogHandler:
  """For a CLI's main(): clean log lines on `stream` (default stderr) in place of absl's
  handler, and a progress bar there when it is a terminal (`bar=False`: none)."""
  global _BAR
  stream = stream or sys.stderr
  root = logging.getLogger()
  for h in list(root.handlers):
    if type(h).__name__ in ("ABSLHandler", "PythonHandler", "CleanLogHandler"):
      root.removeHandler(h)
  handler = CleanLogHandler(stream)
  root.addHandler(handler)
  _BAR = ProgressBar(stream) if bar else None
  return handler


def end_lines(summary: dict, workdir: str) -> list[str]:
  """run_train.py's closing lines after pre-training: where the outputs are and what to run
  next. The numbers (losses, held-out bits/byte, tokens/s, time) are the loop's own `done:`
  line just above; they are not repeated here."""
  return [f"outputs in {workdir}/ (steps {summary['start_step']}..{summary['end_step']}): "
          "checkpoints/, metrics.jsonl, tensorboard/, expert_load.png",
          "next:",
          f"  python run_eval.py --workdir={workdir} --task=all     # ppl, NIAH, MQAR, generate",
          f"  python run_eval.py --workdir={workdir} --task=report  # {workdir}/report.html",
          f"  tensorboard --logdir={workdir}/tensorboard",
          f"  python run_train.py --workdir={workdir} --config.train.steps="
          f"{2 * summary['end_step']}   # train on"]
