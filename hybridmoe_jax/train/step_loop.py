"""The per-step host loop of a run (`run_steps`): next batch -> train step -> metrics,
divergence stop, periodic / stage-end evaluation and checkpoints; a signal stops it after a
checkpoint (`cli.signals.StopFlag`).
"""

from __future__ import annotations

import signal

from absl import logging
import jax
import numpy as np

from hybridmoe_jax.cli.errors import TrainingDiverged
from hybridmoe_jax.cli.signals import StopFlag
from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.train import step as step_lib
from hybridmoe_jax.train.evaluation import eval_info, evaluate, stage_end, stage_info
from hybridmoe_jax.train.monitor import Monitor
from hybridmoe_jax.train.run_inputs import next_batch


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
