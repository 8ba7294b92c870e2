"""`train.profile_steps = "A:B"`: a jax.profiler trace of training steps A..B in workdir/profile.

Steps are numbered as in the progress line (step k brings the state to k). The trace starts
just before step A runs and stops after step B, once its result is computed (the step is
blocked on, so the trace holds the device work, not only the dispatch). Open it with
`tensorboard --logdir W/profile` (profile plugin) or load the `*.trace.json.gz` under
W/profile/plugins/profile/<run>/ into https://ui.perfetto.dev.
"""

from __future__ import annotations

import os
from typing import Callable

from absl import logging
import jax

from hybridmoe_jax.config.run import parse_profile_steps


class StepProfiler:
  """Wraps the train step: starts / stops a trace around steps A..B (a no-op when off)."""

  def __init__(self, spec: str, workdir: str, start_step: int):
    self.window = parse_profile_steps(spec)
    self.logdir = os.path.join(workdir, "profile")
    self.step = start_step        # steps done so far
    self.active = False

  def wrap(self, train_step: Callable) -> Callable:
    if self.window is None:
      return train_step

    def profiled(state, batch):
      first, last = self.window
      n = self.step + 1          # the step about to run
      if not self.active and first <= n <= last:
        os.makedirs(self.logdir, exist_ok=True)
        jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
        self.active = True
        logging.info("profiling steps %d..%d into %s", n, last, self.logdir)
      with jax.profiler.StepTraceAnnotation("train", step_num=n):
        out = train_step(state, batch)
      self.step = n
      if self.active and n >= last:
        jax.block_until_ready(out)
        self.close()
      return out

    return profiled

  def close(self) -> None:
    """Stop a running trace (the end of the window, or a run that stopped inside it)."""
    if self.active:
      self.active = False
      jax.profiler.stop_trace()
      logging.info("profile written to %s (tensorboard --logdir %s, or the .trace.json.gz in "
                   "https://ui.perfetto.dev)", self.logdir, self.logdir)
