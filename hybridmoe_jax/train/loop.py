"""`train_and_evaluate(config, workdir)`: the whole run, resumable at any step.

Order: the typed run config and its plan (every bad field stops here) -> the tokenizer of
`data.tokenizer` (a missing / corrupt file or a vocabulary larger than the model's stops
here) -> check the workdir's stored model config, copy the tokenizer into
workdir/tokenizer/ -> build data (every bad input stops here, before any allocation) -> restore the newest good checkpoint or initialise
-> steps, with periodic eval / checkpoint / heatmap and always a checkpoint at the end or on
SIGINT/SIGTERM -> optional params-only export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import math
import os
import signal
import time
from typing import Any

from absl import logging
from flax import nnx
import jax
import ml_collections
import numpy as np

from hybridmoe_jax.config import ConfigError, ModelConfig
from hybridmoe_jax.data import curriculum as data_curriculum
from hybridmoe_jax.data import pipeline as data_pipeline
from hybridmoe_jax.data import tokenizer as tokenizer_lib
from hybridmoe_jax.data import vlm_pipeline
from hybridmoe_jax.model.impls import log_impls
from hybridmoe_jax.parallel import runtime as parallel_runtime
from hybridmoe_jax.run_config import RunConfig, run_config_from_dict
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import optim, params_export
from hybridmoe_jax.train import plan as plan_lib
from hybridmoe_jax.train import run_inputs
from hybridmoe_jax.train import step as step_lib
from hybridmoe_jax.train import workdir_lock
from hybridmoe_jax.train.monitor import Monitor, fmt_rate, hardware
from hybridmoe_jax.train.terminal import fmt_duration
from hybridmoe_jax.train.profile import StepProfiler
from hybridmoe_jax.train.run_errors import (InputError, OutOfMemory, TrainingDiverged,
                                            checked_workdir_path, is_out_of_memory,
                                            make_writable_workdir, oom_message)
from hybridmoe_jax.train.state import abstract_train_state, create_train_state

def run_tokenizer(run: RunConfig, *, check_vocab: bool = True) -> tokenizer_lib.Tokenizer:
  """The tokenizer of `data.tokenizer` (image roles for a vision model), checked against
  model.vocab_size. Raises InputError (one line naming the file / field) before any compute."""
  try:
    tok = tokenizer_lib.make_tokenizer(run.data.tokenizer, vision=run.model.vision.enabled)
    if check_vocab:
      tokenizer_lib.check_vocab(tok, run.model.vocab_size)
  except ValueError as e:
    raise InputError(f"data.tokenizer: {e}" if not str(e).startswith("data.tokenizer")
                     else str(e)) from None
  return tok


def build_data(run: RunConfig, plan: plan_lib.Plan,
               tokenizer: tokenizer_lib.Tokenizer | None = None):
  """Train iterator + held-out batches: the curriculum's stages, image-text + text for a
  vision model, else the `data` section's text (`hybridmoe_jax.data.pipeline`).

  tokenizer: default `run_tokenizer(run)`; the data's `.tokenizer` is this one."""
  cfg, t = run.model, run.train
  tokenizer = tokenizer or run_tokenizer(run)
  try:
    if plan.curriculum:  # staged context curriculum (data/curriculum.py)
      return data_curriculum.build_curriculum_data(
          plan.stages, run.curriculum, run.data, vocab_size=cfg.vocab_size, seed=t.seed,
          eval_batches=t.eval_batches, vision=cfg.vision, tokenizer=tokenizer)
    if cfg.vision.enabled:  # image-text mixed with text (data/vlm_pipeline.py)
      return vlm_pipeline.build_vlm_train_and_eval(
          run.data, cfg.vision, vocab_size=cfg.vocab_size, seq_len=t.seq_len,
          batch_size=t.batch_size, seed=t.seed, max_eval_batches=t.eval_batches,
          tokenizer=tokenizer)
    # Multi-host: each process loads its own batch_size / process_count rows (its shard).
    return data_pipeline.build_train_and_eval(
        run.data, vocab_size=cfg.vocab_size, seq_len=t.seq_len,
        batch_size=t.batch_size // jax.process_count(), seed=t.seed,
        max_eval_batches=t.eval_batches, shard_index=jax.process_index(),
        shard_count=jax.process_count(), tokenizer=tokenizer)
  except ConfigError:
    raise
  except (ValueError, OSError) as e:  # missing path, empty dataset, ids beyond the vocab
    raise InputError(f"data: {e}") from e


def check_batch(batch: dict[str, np.ndarray], t, vocab_size: int, step: int,
                want: tuple[int, int] | None = None) -> None:
  """Shape, dtype and token-range checks on a host batch (cheap, every step).

  `want`: the expected [rows, seq_len] (a curriculum stage's); default from `t`.
  """
  want = want or (t.batch_size // jax.process_count(), t.seq_len)  # this process's rows
  for key in ("tokens", "segment_ids"):
    if key not in batch:
      raise InputError(f"data batch at step {step} has no {key!r} field (got {sorted(batch)})")
    arr = np.asarray(batch[key])
    if arr.shape != want or not np.issubdtype(arr.dtype, np.integer):
      raise InputError(f"data batch at step {step}: {key} has shape {arr.shape} dtype "
                       f"{arr.dtype}; expected integer [batch_size, seq_len] = {list(want)}")
  tokens = np.asarray(batch["tokens"])
  lo, hi = int(tokens.min()), int(tokens.max())
  if lo < 0 or hi >= vocab_size:
    bad = hi if hi >= vocab_size else lo
    raise InputError(f"data batch at step {step} holds token id {bad}, outside the model "
                     f"vocabulary [0, {vocab_size}) (model.vocab_size = {vocab_size})")


def _next_batch(it, t, vocab_size: int, step: int) -> dict[str, np.ndarray]:
  try:
    batch = next(it)
  except StopIteration:
    raise InputError(f"the training data ran out at step {step}: the dataset is empty or "
                     "too small for one batch of "
                     f"{t.batch_size} x {t.seq_len} tokens") from None
  check_batch(batch, t, vocab_size, step, getattr(it, "batch_shape", None))
  return batch


def evaluate(eval_step, state, batches, token_bytes: np.ndarray | None = None
             ) -> dict[str, float]:
  """Mean held-out NLL per target token and bits per byte.

  token_bytes: int32 [vocab] UTF-8 bytes of each id (`Tokenizer.token_bytes()`; default
  the byte tokenizer's): the bytes of the held-out text are the sum over its targets.
  """
  if token_bytes is None:
    token_bytes = tokenizer_lib.ByteTokenizer(vision=True).token_bytes()
  token_bytes = np.asarray(token_bytes)
  nll = count = nbytes = 0.0
  for b in batches:
    n, c = eval_step(state.params, state.biases, step_lib.model_inputs(b), state.rest)
    targets, weights = step_lib.next_token_targets(np.asarray(b["tokens"]),
                                                   np.asarray(b["segment_ids"]))
    nll += float(n)
    count += float(c)
    # Every process holds the same held-out rows (nll and count cover all of them).
    targets = np.clip(np.asarray(targets), 0, len(token_bytes) - 1)  # check_batch bounds ids
    nbytes += float(np.sum(np.asarray(weights) * token_bytes[targets])) * jax.process_count()
  if not count:
    return {}
  # Special targets (EOS) hold no bytes; their NLL is charged to the text, as usual for bpb.
  return {"loss": nll / count, "bits_per_byte": nll / max(nbytes, 1.0) / math.log(2),
          "tokens": count}


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


def _dump_stacks_on_sigusr1() -> None:
  """`kill -USR1 <pid>` prints every thread's Python stack (to inspect a stuck run)."""
  try:
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
  except (AttributeError, ValueError, RuntimeError):  # no SIGUSR1 (Windows) / not main thread
    pass


def _log_sizes(state) -> None:
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
  n_bias = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.biases))
  logging.info("model: %s parameters, %s routing-bias entries", f"{n_params:,}", f"{n_bias:,}")


def _restore_or_init(ckpt, cfg: ModelConfig, run: RunConfig, tx, data, model_dict,
                     rt: parallel_runtime.Runtime):
  """-> graphdef, state, state-layout signature, the restored checkpoint's meta (None when
  training starts afresh)."""
  t, compute = run.train, run.compute
  graphdef, abstract = abstract_train_state(cfg, compute, tx, t.seed,
                                            moe_dispatch=rt.moe_dispatch, context=rt.context)
  signature = ckpt_lib.structure_signature(abstract)
  # On a mesh: restored straight into this run's shardings (the saving mesh may differ).
  restored = ckpt.restore_latest(rt.restore_target(abstract), model_dict)
  if restored is None:
    if ckpt.skipped:
      logging.warning("no usable checkpoint in %s (%d set aside: %s): training starts again "
                      "at step 0", ckpt.directory, len(ckpt.skipped),
                      "; ".join(f"step {s}: {why}" for s, why in ckpt.skipped))
    state = rt.init_state(lambda: create_train_state(cfg, compute, tx, t.seed,
                                                     moe_dispatch=rt.moe_dispatch,
                                                     context=rt.context)[1],
                          abstract)
    return graphdef, state, signature, None
  state, data_state, meta = restored
  data.train.set_state(data_state)
  return graphdef, state, signature, meta


def _stage_info(it, step: int, plan: plan_lib.Plan) -> dict[str, int]:
  """Curriculum runs: stage, seq_len of the last batch and tokens seen; else {}."""
  stage = getattr(it, "stage", None)
  if stage is None:
    return {}
  return {"stage": stage, "seq_len": it.batch_shape[1], "tokens_seen": plan.tokens_seen(step)}


def _eval_info(data, step: int, plan: plan_lib.Plan, batches=None) -> dict[str, int]:
  """`_stage_info` plus the held-out batches' length (curriculum runs)."""
  info = _stage_info(data.train, step, plan)
  batches = data.eval_batches if batches is None else batches
  if info and batches:
    info["eval_seq_len"] = int(np.asarray(batches[0]["tokens"]).shape[1])
  return info


def _stage_end(step: int, state, *, plan: plan_lib.Plan, data, eval_step, monitor: Monitor,
               token_bytes: np.ndarray, on_stage_end) -> None:
  """A curriculum stage ended at `step`: held-out loss at the stage's own length and at the
  evaluation length, then `on_stage_end(step, stage, state)` (its dict goes to the JSONL)."""
  stage = plan.stage_at(step - 1)
  own = getattr(data, "stage_eval_batches", {}).get(stage.seq_len)
  for batches in ([own] if own else []) + [data.eval_batches]:
    monitor.log_eval(step, evaluate(eval_step, state, batches, token_bytes),
                     _eval_info(data, step, plan, batches))
  _stage_hook(on_stage_end, step, stage, state, monitor)


def _stage_hook(on_stage_end, step: int, stage: plan_lib.StagePlan, state,
                monitor: Monitor) -> None:
  """on_stage_end(step, stage, state) if given; a dict it returns goes to metrics.jsonl."""
  if on_stage_end is not None:
    record = on_stage_end(step, stage, state)
    if record:
      monitor.write_jsonl({"step": step, "stage": stage.index, **record})


def _run_steps(state, step: int, *, t, plan: plan_lib.Plan, cfg: ModelConfig, data,
               train_step, eval_step, monitor: Monitor, ckpt, meta: dict, saved_at: int,
               token_bytes: np.ndarray, on_stage_end=None):
  """Steps until `t.steps` or a signal; periodic eval and checkpoints; a curriculum's
  stage-end evaluations (`_stage_end`).

  Returns:
    (state, step, saved_at: the last checkpointed step, stopped_by: signal name or None).
  """
  streak = 0  # updates skipped in a row (non-finite loss, gradient or update)
  with StopFlag() as stop:
    while step < t.steps:
      batch = _next_batch(data.train, t, cfg.vocab_size, step)
      state, metrics = train_step(state,
                                  step_lib.model_inputs(batch, step_lib.TRAIN_INPUT_KEYS))
      step += 1
      metrics = jax.device_get(metrics)
      streak = 0 if bool(metrics["finite"]) else streak + 1
      monitor.step(step, {**metrics, **_stage_info(data.train, step, plan)})
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
        _stage_end(step, state, plan=plan, data=data, eval_step=eval_step, monitor=monitor,
                   token_bytes=token_bytes, on_stage_end=on_stage_end)
      elif t.eval_every and step % t.eval_every == 0 and step < t.steps:
        monitor.log_eval(step, evaluate(eval_step, state, data.eval_batches, token_bytes),
                         _eval_info(data, step, plan))
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


def train_and_evaluate(config: ml_collections.ConfigDict | RunConfig, workdir: str, *,
                       export_params_to: str | None = None, data=None,
                       on_stage_end=None) -> dict[str, Any]:
  """Train `config` in `workdir` (resuming from its newest good checkpoint).

  Args:
    config: the root ConfigDict of a preset (model, compute, train, data, mesh, curriculum)
      or the `RunConfig` built from one.
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
  config = run_config_from_dict(config)  # typed and checked from here on
  wall0 = time.time()
  _dump_stacks_on_sigusr1()
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
    tokenizer_lib.save_tokenizer(tokenizer, os.path.join(directory, tokenizer_lib.TOKENIZER_DIR))
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
                  tokenizer: tokenizer_lib.Tokenizer, on_stage_end=None) -> dict[str, Any]:
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
  ckpt = ckpt_lib.Checkpointer(workdir, keep=t.keep_checkpoints, async_save=t.async_checkpoints)
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
  log_impls(cfg, config.compute, moe_dispatch=rt.moe_dispatch)
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
    state, step, saved_at, stopped = _run_steps(
        state, start, t=t, plan=plan, cfg=cfg, data=data, on_stage_end=stage_hook,
        eval_step=eval_step, monitor=monitor, token_bytes=token_bytes,
        train_step=profiler.wrap(train_step),
        ckpt=ckpt, meta=meta,
        saved_at=start if restored is not None else -1)
    if stopped is None:
      eval_metrics = evaluate(eval_step, state, data.eval_batches, token_bytes)
      monitor.log_eval(step, eval_metrics, _eval_info(data, step, plan))
      if plan.curriculum and step == plan.total_steps:  # the last stage ends the run
        _stage_hook(stage_hook, step, plan.stages[-1], state, monitor)
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
