"""`train_and_evaluate(run, workdir)`: the run driver, resumable at any step.

Order: the plan of the typed `RunConfig` -> the tokenizer of `data.tokenizer` (a missing /
corrupt file or a vocabulary larger than the model's stops here) -> check the workdir's
stored model config, copy the tokenizer into workdir/tokenizer/ -> build data (every bad
input stops here, before any allocation; `run_inputs`) -> restore the newest good checkpoint
or initialise -> steps (`step_loop.run_steps`), with periodic eval (`evaluation`) /
checkpoint / heatmap and always a checkpoint at the end or on SIGINT/SIGTERM -> optional
params-only export (`params_export`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any

from absl import logging
from flax import nnx
import jax
import numpy as np

from hybridmoe_jax.cli import workdir_lock
from hybridmoe_jax.cli.errors import (InputError, OutOfMemory, checked_workdir_path,
                                      is_out_of_memory, make_writable_workdir, oom_message)
from hybridmoe_jax.cli.signals import dump_stacks_on_sigusr1
from hybridmoe_jax.cli.terminal import fmt_duration
from hybridmoe_jax.config import ConfigError, ModelConfig
from hybridmoe_jax.data import curriculum as data_curriculum
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers.load import TOKENIZER_DIR, save_tokenizer
from hybridmoe_jax.model.impls import log_impls
from hybridmoe_jax.parallel import runtime as parallel_runtime
from hybridmoe_jax.config.run import RunConfig
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import optim, params_export
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.train import run_inputs
from hybridmoe_jax.train import step as step_lib
from hybridmoe_jax.train.evaluation import eval_info, evaluate, run_stage_hook
from hybridmoe_jax.train.monitor import Monitor, fmt_rate, hardware
from hybridmoe_jax.train.profile import StepProfiler
from hybridmoe_jax.train.run_inputs import build_data, run_tokenizer
from hybridmoe_jax.train.state import abstract_train_state, create_train_state
from hybridmoe_jax.train.step_loop import run_steps


def _log_sizes(state) -> None:
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  n_bias = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.biases))
  logging.info("model: %s parameters, %s routing-bias entries", f"{n_params:,}", f"{n_bias:,}")


def _restore_or_init(ckpt, cfg: ModelConfig, run: RunConfig, tx, data, model_dict,
                     rt: parallel_runtime.Runtime):
  """-> graphdef, state, state-layout signature, the restored checkpoint's meta (None when
  training starts afresh)."""
  t, compute = run.train, run.compute
  graphdef, abstract = abstract_train_state(cfg, compute, tx, t.seed)
  signature = ckpt_lib.structure_signature(abstract)
  # On a mesh: restored straight into this run's shardings (the saving mesh may differ).
  restored = ckpt.restore_latest(rt.restore_target(abstract), model_dict)
  if restored is None:
    if ckpt.skipped:
      logging.warning("no usable checkpoint in %s (%d set aside: %s): training starts again "
                      "at step 0", ckpt.directory, len(ckpt.skipped),
                      "; ".join(f"step {s}: {why}" for s, why in ckpt.skipped))
    state = rt.init_state(lambda: create_train_state(cfg, compute, tx, t.seed)[1], abstract)
    return graphdef, state, signature, None
  state, data_state, meta = restored
  data.train.set_state(data_state)
  return graphdef, state, signature, meta


def train_and_evaluate(config: RunConfig, workdir: str, *,
                       export_params_to: str | None = None, data=None,
                       on_stage_end=None) -> dict[str, Any]:
  """Train `config` in `workdir` (resuming from its newest good checkpoint).

  Args:
    config: the typed run config (`run_config_from_dict` of a preset's ConfigDict: the
      CLI, or the caller, converts and checks it once).
    workdir: checkpoints, TensorBoard events, metrics.jsonl and heatmaps go here.
    export_params_to: if set, write a params-only checkpoint there at the end.
    data: object with `.train` (checkpointable iterator) and `.eval_batches` (default:
      `build_data(config, plan)`).
    on_stage_end: curriculum runs: called as on_stage_end(step, stage: StagePlan, model)
      after each stage's held-out evaluation (the last stage's at the end of the run), with
      the model (`HybridLM`) holding the current parameters; a dict it returns is written
      to metrics.jsonl (e.g. `evals.stage_niah.StageNiah`: a NIAH grid per stage).

  Returns:
    A summary: steps, first/last loss, final eval, tokens/s, wall time, alerts, final state.

  Raises:
    ConfigError / InputError: bad config or input, before training starts (token ids are
      also checked on every later batch).
  """
  if not isinstance(config, RunConfig):
    raise TypeError(f"train_and_evaluate takes a RunConfig, got {type(config).__name__}: "
                    "convert a ConfigDict once with run_config.run_config_from_dict")
  wall0 = time.time()
  dump_stacks_on_sigusr1()
  workdir = checked_workdir_path(workdir)  # absolute: orbax wants absolute paths
  plan = plan_lib.build_plan(config)  # once per run: stages, batches, the LR schedule
  # A bad tokenizer file stops here, before the workdir. Data given by the caller brings its
  # own ids (checked batch by batch) and may bring its tokenizer.
  tokenizer = (getattr(data, "tokenizer", None) if data is not None else None
               ) or run_tokenizer(config, check_vocab=data is None)
  t = config.train
  if export_params_to and os.path.exists(export_params_to):
    raise InputError(f"--export_params_to={export_params_to} already exists; choose a new path")
  make_writable_workdir(workdir)
  # One run per workdir, taken before anything in it is read or moved: a second run must not
  # set aside the first one's save in progress as "partial".
  lock = (workdir_lock.WorkdirLock(workdir, stale_after_s=t.lock_stale_s)
          if jax.process_index() == 0 else contextlib.nullcontext())
  try:
    with lock:
      return _train_locked(config, workdir, plan, export_params_to, data, wall0, tokenizer,
                           on_stage_end)
  except workdir_lock.WorkdirBusy as e:
    raise InputError(str(e)) from None


def _save_tokenizer(tokenizer, directory: str) -> None:
  """Copy a file tokenizer into `directory`/tokenizer (InputError if another one is there)."""
  if jax.process_index() != 0:
    return
  try:
    save_tokenizer(tokenizer, os.path.join(directory, TOKENIZER_DIR))
  except ValueError as e:
    raise InputError(str(e)) from None


def _loss_text(monitor: Monitor) -> str:
  if monitor.first_loss is None:
    return ""
  return f", loss {monitor.first_loss:.4f} -> {monitor.last_loss:.4f}"


def _eval_text(metrics: dict[str, float]) -> str:
  """', held-out loss 3.4375 (4.960 bits/byte)' or '' without a held-out evaluation."""
  if not metrics:
    return ""
  bpb = f" ({metrics['bits_per_byte']:.3f} bits/byte)" if "bits_per_byte" in metrics else ""
  return f", held-out loss {metrics['loss']:.4f}{bpb}"


def _export(path: str, state, model_dict: dict, tokenizer) -> None:
  """`--export_params_to`: params + routing biases + config, and the tokenizer (an export is
  self-contained too: it goes in before the final rename)."""
  path = params_export.export_params(path, state.params, state.biases, model_dict,
                                     also=lambda d: _save_tokenizer(tokenizer, d))
  logging.info("exported parameters and routing biases to %s", path)


def _already_finished(workdir: str, step: int, state, ckpt, export_params_to: str | None,
                      model_dict: dict, tokenizer, wall0: float) -> dict[str, Any]:
  """A rerun of a run whose newest checkpoint is at train.steps: no step, no log record;
  only the export asked for (`--export_params_to` on a finished run)."""
  ckpt.close()
  logging.info("%s already finished at step %d; raise --config.train.steps to continue",
               workdir, step)
  if export_params_to:
    _export(export_params_to, state, model_dict, tokenizer)
  return {"start_step": step, "end_step": step, "first_loss": None, "last_loss": None,
          "eval": {}, "tokens_per_sec": float("nan"), "wall_s": time.time() - wall0,
          "skipped_steps": int(state.skipped), "alerts": {}, "stopped_by": None,
          "state": state, "already_finished": True}


def _train_locked(config: RunConfig, workdir: str, plan: plan_lib.Plan,
                  export_params_to: str | None, data, wall0: float,
                  tokenizer: Tokenizer, on_stage_end=None) -> dict[str, Any]:
  """train_and_evaluate's body, run while holding the workdir lock."""
  cfg, t = config.model, config.train
  model_dict = dataclasses.asdict(cfg)
  schedule = plan.schedule()
  ckpt_lib.check_workdir_config(workdir, model_dict, repair=True)
  # The run is self-contained: evals read workdir/tokenizer (tokenizer_from_dir).
  _save_tokenizer(tokenizer, workdir)
  # Mesh from config.mesh; bad sizes stop here.
  rt = parallel_runtime.setup(dataclasses.asdict(config.mesh), cfg, config.compute,
                              batch_size=t.batch_size, grad_accum=t.grad_accum,
                              seq_len=t.seq_len)
  data = data if data is not None else build_data(config, plan, tokenizer)
  token_bytes = tokenizer.token_bytes()
  image_ids = tuple(i for i in (tokenizer.image_start_id, tokenizer.image_end_id,
                                tokenizer.image_pad_id) if i is not None)
  tx = optim.make_optimizer(t, schedule)
  ckpt = ckpt_lib.Checkpointer(workdir, keep=t.keep_checkpoints, async_save=t.async_checkpoints,
                               directory=t.checkpoint_dir or None)
  graphdef, state, signature, restored = _restore_or_init(ckpt, cfg, config, tx, data,
                                                          model_dict, rt)
  start = int(state.step)
  if jax.process_index() == 0:  # tokenizer / data fingerprints (workdir/inputs.json)
    try:
      run_inputs.check_and_record(workdir, config, tokenizer, schedule=schedule,
                                  resumed_at=start if restored is not None else None,
                                  saved_config=(restored or {}).get("config"))
    except run_inputs.TokenizerChanged:
      ckpt.close()
      raise
  if restored is not None:
    if t.steps < start:
      ckpt.close()
      raise ConfigError(
          f"config field `train.steps` = {t.steps} is below the step of the restored "
          f"checkpoint ({start}, in {ckpt.directory}); allowed: >= {start} (raise it to "
          "train on, or use a fresh --workdir)")
    run_inputs.warn_changed_settings(restored.get("config"), config, start)
    if start == t.steps:  # nothing to train: leave metrics, TensorBoard and checkpoints alone
      return _already_finished(workdir, start, state, ckpt, export_params_to, model_dict,
                               tokenizer, wall0)
  ckpt_lib.write_workdir_config(workdir, model_dict)
  _log_sizes(state)
  log_impls(cfg, config.compute, plan=rt.plan)
  meta = {"model_config": model_dict, "signature": signature,
          "config": json.dumps(dataclasses.asdict(config))}
  eval_step = step_lib.make_eval_step(graphdef, image_ids=image_ids,
                                      **rt.step_kwargs(train=False))
  train_step = step_lib.make_train_step(graphdef, cfg, tx, grad_accum=t.grad_accum,
                                        schedule=schedule, image_ids=image_ids,
                                        **rt.step_kwargs())
  # Multi-process: only process 0 writes the run's logs; the others log under process_<i>/.
  logdir = workdir if jax.process_index() == 0 else os.path.join(
      workdir, f"process_{jax.process_index()}")
  os.makedirs(logdir, exist_ok=True)
  monitor = Monitor(logdir, t, start_step=start, total_steps=t.steps,
                    tokens_seen=plan.tokens_seen)
  monitor.write_jsonl({"event": "resume" if restored is not None else "start", "step": start,
                       **hardware()})
  profiler = StepProfiler(t.profile_steps, logdir, start)
  logging.info("training steps %d..%d in %s", start, t.steps, workdir)
  eval_metrics = {}
  stage_hook = None if on_stage_end is None else (
      lambda step, stage, st: on_stage_end(
          step, stage, nnx.merge(graphdef, st.params, st.biases, st.rest)))
  try:
    state, step, saved_at, stopped = run_steps(
        state, start, t=t, plan=plan, cfg=cfg, data=data, on_stage_end=stage_hook,
        eval_step=eval_step, monitor=monitor, token_bytes=token_bytes,
        train_step=profiler.wrap(train_step),
        ckpt=ckpt, meta=meta,
        saved_at=start if restored is not None else -1)
    if stopped is None:
      eval_metrics = evaluate(eval_step, state, data.eval_batches, token_bytes)
      monitor.log_eval(step, eval_metrics, eval_info(data, step, plan))
      if plan.curriculum and step == plan.total_steps:  # the last stage ends the run
        run_stage_hook(stage_hook, step, plan.stages[-1], state, monitor)
      if saved_at != step:
        ckpt.save(step, state, data.train.get_state(), meta)
    ckpt.wait()
    if export_params_to and stopped is None:
      _export(export_params_to, state, model_dict, tokenizer)
  except Exception as e:  # pylint: disable=broad-except
    if not is_out_of_memory(e):
      raise
    raise OutOfMemory(oom_message(e, config)) from None
  finally:
    profiler.close()
    ckpt.close()
    monitor.close()
    if isinstance(data, data_curriculum.CurriculumData):  # its stage's grain workers
      data.train.close()
  summary = {
      "start_step": start, "end_step": step, "first_loss": monitor.first_loss,
      "last_loss": monitor.last_loss, "eval": eval_metrics,
      "tokens_per_sec": monitor.tokens_per_sec, "wall_s": time.time() - wall0,
      "skipped_steps": int(state.skipped), "alerts": dict(monitor.alerts),
      "stopped_by": stopped, "state": state,
  }
  if stopped:
    logging.warning("stopped by %s at step %d; checkpoint saved, rerun to resume", stopped, step)
  else:
    logging.info("done: step %d%s%s, %s tok/s, %s", step, _loss_text(monitor),
                 _eval_text(eval_metrics), fmt_rate(monitor.tokens_per_sec),
                 fmt_duration(summary["wall_s"]))
  return summary
