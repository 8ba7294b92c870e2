"""The per-step host loop of a run (`run_steps`): next batch -> train step -> metrics,
divergence stop, periodic / stage-end evaluation and checkpoints; and how signals stop it
(SIGINT/SIGTERM: `StopFlag`, a checkpoint, then exit; a second one: `abort_now`; SIGUSR1:
every thread's stack).
"""

from __future__ import annotations

import faulthandler
import os
import signal

from absl import logging
import jax
import numpy as np

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.train import step as step_lib
from hybridmoe_jax.train import workdir_lock
from hybridmoe_jax.train.evaluation import eval_info, evaluate, stage_end, stage_info
from hybridmoe_jax.train.monitor import Monitor
from hybridmoe_jax.train.run_inputs import next_batch
from hybridmoe_jax.train.run_errors import TrainingDiverged


class StopFlag:
  """SIGINT/SIGTERM -> finish the current step, checkpoint, exit cleanly. A second signal
  (also while that checkpoint is written, after the flag's block) stops the process at
  once with one line (`abort_now`). Also the RL run's (rl/trainer.py: the current
  iteration)."""

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


def run_steps(state, step: int, *, t, plan: plan_lib.Plan, cfg: ModelConfig, data,
              train_step, eval_step, monitor: Monitor, ckpt, meta: dict, saved_at: int,
              token_bytes: np.ndarray, on_stage_end=None):
  """Steps until `t.steps` or a signal; periodic eval and checkpoints; a curriculum's
  stage-end evaluations (`stage_end`).

  Returns:
    (state, step, saved_at: the last checkpointed step, stopped_by: signal name or None).
  """
  streak = 0  # updates skipped in a row (non-finite loss, gradient or update)
  with StopFlag() as stop:
    while step < t.steps:
      batch = next_batch(data.train, t, cfg.vocab_size, step)
      state, metrics = train_step(state,
                                  step_lib.model_inputs(batch, step_lib.TRAIN_INPUT_KEYS))
      step += 1
      metrics = jax.device_get(metrics)
      streak = 0 if bool(metrics["finite"]) else streak + 1
      monitor.step(step, {**metrics, **stage_info(data.train, step, plan)})
      if streak >= t.max_consecutive_skips:
        last = ckpt.latest_step()
        raise TrainingDiverged(
            f"training diverged: the last {streak} updates (steps {step - streak + 1}.."
            f"{step}) were skipped for a non-finite loss, gradient or update "
            f"(train.max_consecutive_skips = {t.max_consecutive_skips}); nothing was saved "
            f"after it; the newest checkpoint is " +
            (f"step {last}" if last is not None else "none") +
            ". Lower train.lr, raise train.warmup or set train.clip > 0, then rerun")
      if step in getattr(data, "eval_at", ()) and step < t.steps:
        stage_end(step, state, plan=plan, data=data, eval_step=eval_step, monitor=monitor,
                  token_bytes=token_bytes, on_stage_end=on_stage_end)
      elif t.eval_every and step % t.eval_every == 0 and step < t.steps:
        monitor.log_eval(step, evaluate(eval_step, state, data.eval_batches, token_bytes),
                         eval_info(data, step, plan))
      due = t.checkpoint_every and step % t.checkpoint_every == 0
      if due and streak:  # the state may be a dead end: keep the older checkpoints newest
        logging.warning("step %d: checkpoint deferred (the last %d updates were skipped)",
                        step, streak)
      elif due or stop.signum:
        ckpt.save(step, state, data.train.get_state(), meta)
        saved_at = step
      if stop.signum:
        return state, step, saved_at, signal.Signals(stop.signum).name
  return state, step, saved_at, None
