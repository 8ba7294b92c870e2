"""`train_and_evaluate(run, workdir)`: the run driver, resumable at any step.

Order: the plan of the typed `RunConfig` -> the tokenizer of `data.tokenizer` (a missing /
corrupt file or a vocabulary larger than the model's stops here) -> the run's lifecycle
(`lifecycle.open_run`: workdir lock and config, tokenizer copy, runtime, then the data built
(every bad input stops here, before any allocation; `run_inputs`), optimizer, checkpointer,
restore the newest good checkpoint or initialise) -> resume checks -> steps
(`step_loop.run_steps`), with periodic eval (`evaluation`) / checkpoint / heatmap and always
a checkpoint at the end or on SIGINT/SIGTERM -> optional params-only export
(`params_export`).
"""

from __future__ import annotations

import os
import time
from typing import Any

from absl import logging
from flax import nnx
import jax

from hybridmoe_jax.cli.errors import InputError, OutOfMemory, is_out_of_memory, oom_message
from hybridmoe_jax.cli.terminal import fmt_duration
from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.sharding import DATA_AXES
from hybridmoe_jax.config.run import RunConfig
from hybridmoe_jax.data import curriculum as data_curriculum
from hybridmoe_jax.data import storage
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.parallel import mesh as mesh_lib
from hybridmoe_jax.train import lifecycle, params_export, run_inputs
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.train import step as step_lib
from hybridmoe_jax.train.evaluation import eval_info, evaluate, run_stage_hook
from hybridmoe_jax.train.monitor import Event, fmt_rate, hardware
from hybridmoe_jax.train.profile import StepProfiler
from hybridmoe_jax.train.run_inputs import build_data, run_tokenizer
from hybridmoe_jax.train.step_loop import run_steps


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
  plan = plan_lib.build_plan(config)  # once per run: stages, batches, the LR schedule
  # A bad tokenizer file stops here, before the workdir. Data given by the caller brings its
  # own ids (checked batch by batch) and may bring its tokenizer.
  tokenizer = (getattr(data, "tokenizer", None) if data is not None else None
               ) or run_tokenizer(config, check_vocab=data is None)
  t = config.train
  if export_params_to and _exists(export_params_to):
    raise InputError(f"--export_params_to={export_params_to} already exists; choose a new path")
  with lifecycle.open_run(
      config, workdir, tokenizer, schedule=plan.schedule(), batch_size=t.batch_size,
      grad_accum=t.grad_accum, seq_len=t.seq_len,
      prepare=lambda rt: _stages_fit(rt, config, plan) or (
          data if data is not None else build_data(config, plan, tokenizer)),
  ) as run:
    summary = _train(run, plan, export_params_to, wall0, tokenizer, on_stage_end)
  # After the checkpoints are written and the logs closed (a terminal's bar ends above).
  if summary.get("already_finished"):
    return summary
  summary["wall_s"] = time.time() - wall0
  if summary["stopped_by"]:
    logging.warning("stopped by %s at step %d; checkpoint saved, rerun to resume",
                    summary["stopped_by"], summary["end_step"])
  else:
    logging.info("done: step %d%s%s, %s tok/s, %s", summary["end_step"], _loss_text(summary),
                 _eval_text(summary["eval"]), fmt_rate(summary["tokens_per_sec"]),
                 fmt_duration(summary["wall_s"]))
  return summary


def _stages_fit(rt, config: RunConfig, plan: plan_lib.Plan) -> None:
  """Every curriculum stage that runs (train.steps may end the run before the last ones) and
  its held-out batches against the resolved mesh (the runtime checked train.*; an axis of -1,
  such as fsdp's default, is known only here), before any data or state: a stage that cannot
  split would fail only when it starts."""
  if rt.mesh is None:
    return
  ran = [s for s in plan.stages if s.start_step < config.train.steps]
  for s in ran:
    try:
      mesh_lib.check_mesh_fits(rt.mesh, num_experts=config.model.moe.num_experts,
                               batch_size=s.batch_size, grad_accum=config.train.grad_accum,
                               seq_len=s.seq_len, context_zigzag=config.mesh.context_zigzag)
    except ConfigError as e:
      raise ConfigError(f"curriculum stage {s.index} ({s.name}: {s.batch_size} sequences of "
                        f"{s.seq_len} tokens a step) does not fit mesh "
                        f"{dict(rt.mesh.shape)}: {e}") from None
  if not plan.curriculum:
    return
  # The held-out batches (data/curriculum.py): max(1, tokens_per_step // T) rows per host at
  # each stage's length and at eval_seq_len, placed like a train batch (host_batch_to_global).
  c, dp = config.curriculum, mesh_lib.axis_size(rt.mesh, DATA_AXES)
  pieces = rt.mesh.shape["context"] * (2 if config.mesh.context_zigzag else 1)
  for length in sorted({s.seq_len for s in ran} | {c.eval_seq_len or plan.stages[-1].seq_len}):
    rows = data_curriculum.heldout_rows(c, length) * jax.process_count()
    if rows % dp or length % pieces:
      raise ConfigError(
          f"the held-out batches at {length:,} tokens ({rows} sequences: max(1, "
          f"curriculum.tokens_per_step // length) per process) do not split over mesh "
          f"{dict(rt.mesh.shape)}: allowed multiples of mesh.data x mesh.fsdp = {dp} "
          f"sequences of a multiple of {pieces} tokens (curriculum.eval_seq_len, "
          "curriculum.tokens_per_step)")


def _exists(path: str) -> bool:
  """Whether `path` (local or gs://) exists; InputError (one line) if a bucket cannot be read."""
  if not storage.is_remote(path):
    return os.path.exists(path)
  try:
    return storage.as_path(path).exists()
  except Exception as e:  # pylint: disable=broad-except  # cloud clients raise many kinds
    raise InputError(str(storage.storage_error(path, e, "write"))) from None


def _loss_text(summary: dict[str, Any]) -> str:
  if summary["first_loss"] is None:
    return ""
  return f", loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}"


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
                                     also=lambda d: lifecycle.save_tokenizer(tokenizer, d))
  logging.info("exported parameters and routing biases to %s", path)


def _already_finished(run: lifecycle.Run, step: int, export_params_to: str | None,
                      tokenizer, wall0: float) -> dict[str, Any]:
  """A rerun of a run whose newest checkpoint is at train.steps: no step, no log record;
  only the export asked for (`--export_params_to` on a finished run)."""
  logging.info("%s already finished at step %d; raise --config.train.steps to continue",
               run.workdir, step)
  if export_params_to:
    _export(export_params_to, run.state, run.model_dict, tokenizer)
  return {"start_step": step, "end_step": step, "first_loss": None, "last_loss": None,
          "eval": {}, "tokens_per_sec": float("nan"), "wall_s": time.time() - wall0,
          "skipped_steps": int(run.state.skipped), "alerts": {}, "stopped_by": None,
          "state": run.state, "already_finished": True}


def _train(run: lifecycle.Run, plan: plan_lib.Plan, export_params_to: str | None,
           wall0: float, tokenizer: Tokenizer, on_stage_end=None
           ) -> dict[str, Any]:
  """train_and_evaluate's own work, inside the run's lifecycle: resume checks, then steps."""
  config, data, state, restored = run.config, run.inputs, run.state, run.restored
  cfg, t = config.model, config.train
  if restored is not None:
    data.train.set_state(restored.data_state)
  token_bytes = tokenizer.token_bytes()
  image_ids = tuple(i for i in (tokenizer.image_start_id, tokenizer.image_end_id,
                                tokenizer.image_pad_id) if i is not None)
  start = int(state.step)
  saved_config = restored.meta.get("config") if restored is not None else None
  if jax.process_index() == 0:  # tokenizer / data fingerprints (workdir/inputs.json)
    run_inputs.check_and_record(run.workdir, config, tokenizer, schedule=run.schedule,
                                resumed_at=start if restored is not None else None,
                                saved_config=saved_config)
  if restored is not None:
    if t.steps < start:
      raise ConfigError(
          f"config field `train.steps` = {t.steps} is below the step of the restored "
          f"checkpoint ({start}, in {run.ckpt.directory}); allowed: >= {start} (raise it to "
          "train on, or use a fresh --workdir)")
    run_inputs.warn_changed_settings(saved_config, config, start)
    if start == t.steps:  # nothing to train: leave metrics, TensorBoard and checkpoints alone
      return _already_finished(run, start, export_params_to, tokenizer, wall0)
  monitor = run.begin(start_step=start, total_steps=t.steps, tokens_seen=plan.tokens_seen)
  monitor.write_jsonl({"event": str(Event.RESUME if restored is not None else Event.START),
                       "step": start, **hardware()})
  graphdef, ckpt, meta, rt = run.graphdef, run.ckpt, run.meta, run.rt
  eval_step = step_lib.make_eval_step(graphdef, image_ids=image_ids,
                                      **rt.step_kwargs(train=False))
  train_step = step_lib.make_train_step(graphdef, cfg, run.tx, grad_accum=t.grad_accum,
                                        schedule=run.schedule, image_ids=image_ids,
                                        **rt.step_kwargs())
  profiler = StepProfiler(t.profile_steps, monitor.workdir, start)
  logging.info("training steps %d..%d in %s", start, t.steps, run.workdir)
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
      _export(export_params_to, state, run.model_dict, tokenizer)
  except Exception as e:  # pylint: disable=broad-except
    if not is_out_of_memory(e):
      raise
    raise OutOfMemory(oom_message(e, config)) from None
  finally:
    profiler.close()
    if isinstance(data, data_curriculum.CurriculumData):  # its stage's grain workers
      data.train.close()
  return {"start_step": start, "end_step": step, "first_loss": monitor.first_loss,
          "last_loss": monitor.last_loss, "eval": eval_metrics,
          "tokens_per_sec": monitor.tokens_per_sec, "skipped_steps": int(state.skipped),
          "alerts": dict(monitor.alerts), "stopped_by": stopped, "state": state}
