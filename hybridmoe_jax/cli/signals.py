"""How signals stop a run: SIGINT/SIGTERM set a `StopFlag` (the run checkpoints, then exits),
a second one calls `abort_now` (exit at once, the run's lock released); SIGUSR1 prints every
thread's stack (`dump_stacks_on_sigusr1`)."""

from __future__ import annotations

import faulthandler
import os
import signal

from absl import logging

from hybridmoe_jax.cli import workdir_lock


class StopFlag:
  """SIGINT/SIGTERM -> finish the current step (pre-training) or iteration (RL), checkpoint,
  exit cleanly. A second signal (also while that checkpoint is written, after the flag's
  block) stops the process at once with one line (`abort_now`)."""

  def __init__(self):
    self.signum = None
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread
        pass
    return self

  def _handle(self, signum, frame):
    if self.signum is not None:
      abort_now(signum, frame)
    self.signum = signum
    logging.warning("received %s: saving a checkpoint after this step, then exiting "
                    "(send it again to abort at once)", signal.Signals(signum).name)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      # After a first signal the run is saving, then exiting: a second one still aborts.
      signal.signal(sig, old if self.signum is None else abort_now)


def abort_now(signum, frame=None) -> None:
  """The second SIGINT / SIGTERM: one line, the run's lock released, exit 128 + signum now,
  as a SIGKILL would (no traceback from wherever the main thread was, e.g. inside orbax).
  A checkpoint being written stays an orbax tmp directory, set aside on the next start."""
  del frame
  os.write(2, (f"error: received {signal.Signals(signum).name} again: stopped at once; a "
               "checkpoint being written is discarded (set aside on the next start), the "
               "committed ones are intact. Rerun to resume\n").encode())
  workdir_lock.drop_held_locks()
  os._exit(128 + signum)  # pylint: disable=protected-access


def dump_stacks_on_sigusr1() -> None:
  """`kill -USR1 <pid>` prints every thread's Python stack (to inspect a stuck run)."""
  try:
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
  except (AttributeError, ValueError, RuntimeError):  # no SIGUSR1 (Windows) / not main thread
    pass
