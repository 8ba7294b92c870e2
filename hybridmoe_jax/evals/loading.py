"""Load a trained model for evaluation: the newest checkpoint of a run, or a params export.

Both read what `hybridmoe_jax.train.checkpoint` writes, through its readers: a run's
`workdir/{model_config.json, checkpoints/<step>/{state, meta}}` via the same
`Checkpointer.restore_latest` that resumes training (same checks, same messages), or an
export's `path/{model_config.json, params.safetensors (or an older params/)}` via
`params_export.load_exported_params` (a converted Hugging Face model is such an export). Loading is read-only: a checkpoint that fails to restore or to match its fingerprint is skipped with a
warning and left in place (the training loop, not an eval, quarantines it), so evaluating a
live run never moves its files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import optax
from flax import nnx

from hybridmoe_jax.config import ModelConfig, migrate_legacy, model_config_from_dict
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.config.run import RunConfig, run_config_from_dict
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import params_export
from hybridmoe_jax.train import optim
from hybridmoe_jax.train.state import abstract_train_state, split_model


def check_model_dir(path: str, what: str) -> None:
  """ValueError (one line naming `what` and `path`) unless `path` is an existing directory
  holding a model config (a run or an export); called before anything else is read, so a
  mistyped path is reported as such (not as a missing config or tokenizer)."""
  if not os.path.exists(path):
    raise ValueError(f"{what} {path} does not exist (a training run directory or a params "
                     "export)")
  if not os.path.isdir(path):
    raise ValueError(f"{what} {path} is a file, not a directory (a training run directory "
                     "or a params export)")
  if not os.path.isfile(os.path.join(path, ckpt_lib.CONFIG_FILE)):
    raise ValueError(f"{what} {path} has no {ckpt_lib.CONFIG_FILE}: not a training run "
                     "directory / params export")


def _read_config(path: str, what: str) -> dict[str, Any]:
  check_model_dir(path, what)
  saved = ckpt_lib.read_model_config(path)
  if saved is None:
    raise ValueError(f"{what} {path}: {ckpt_lib.CONFIG_FILE} cannot be read")
  return saved


def _check_expected(path: str, saved: dict, expected: ModelConfig | None) -> None:
  """ConfigError if a user-given config differs from the one stored with the weights."""
  if expected is not None:
    ckpt_lib.check_model_config(
        saved, dataclasses.asdict(expected), saved_as="stored", current_as="in --config",
        what=f"--config does not match the model stored in {path} ({ckpt_lib.CONFIG_FILE})")


def _saved_run(meta: dict[str, Any]) -> RunConfig:
  """The run config a checkpoint was trained with (older layouts migrated)."""
  return run_config_from_dict(migrate_legacy(json.loads(meta["config"])))


def _abstract_train_state(meta: dict[str, Any]):
  """(graphdef, abstract TrainState) of a checkpoint, from the model, compute and optimizer
  configs stored in its meta; no step is run, so the learning rate is irrelevant (a
  constant schedule shapes the optimizer state like any other)."""
  run = _saved_run(meta)
  cfg = model_config_from_dict(meta["model_config"])
  tx = optim.make_optimizer(run.train, optax.constant_schedule(0.0))
  return abstract_train_state(cfg, run.compute, tx, 0)


def load_from_workdir(workdir: str, expected: ModelConfig | None = None
                      ) -> tuple[HybridLM, dict[str, Any]]:
  """-> (model with the newest good checkpoint's params and routing biases, info).

  Raises:
    ValueError: no run, no checkpoint, or none restorable. ConfigError: the stored
      config differs from `expected`, or a checkpoint from the run's model config or
      train-state layout (`Checkpointer.restore_latest`).
  """
  saved = _read_config(workdir, "--workdir")
  _check_expected(workdir, saved, expected)
  ckpt = ckpt_lib.Checkpointer(workdir, read_only=True)
  graphdefs = []

  def target(meta):
    graphdef, abstract = _abstract_train_state(meta)
    graphdefs.append(graphdef)
    # Onto this process's default device, whatever mesh saved it (a run trained on 8
    # devices is evaluated, served and chatted with on one): without a sharding per leaf
    # orbax would restore onto the saving devices and refuse a different device set.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                        abstract)

  try:
    restored = ckpt.restore_latest(target, saved)
  finally:
    ckpt.close()
  if restored is None:
    if not ckpt.skipped:
      raise ValueError(f"--workdir {workdir} holds no finished checkpoint in {ckpt.directory}")
    raise ValueError(f"no checkpoint in {ckpt.directory} could be restored: " + "; ".join(
        f"step {step}: {why}" for step, why in ckpt.skipped))
  state, _, meta = restored
  model = nnx.merge(graphdefs[-1], state.params, state.biases, state.rest)
  return model, {"source": "workdir", "path": workdir, "step": meta["step"],
                 "skipped": [{"step": step, "why": why} for step, why in ckpt.skipped],
                 "data_config": _saved_run(meta).data}


def load_from_params(path: str, expected: ModelConfig | None = None
                     ) -> tuple[HybridLM, dict[str, Any]]:
  """-> (model from a params-only export, info). ValueError if arrays and config disagree."""
  saved = _read_config(path, "--params")
  _check_expected(path, saved, expected)
  cfg = model_config_from_dict(saved)
  abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, biases, rest = split_model(abstract)
  params_export.load_into(path, params, biases)
  return nnx.merge(graphdef, params, biases, rest), {"source": "params", "path": path}


def load_model(*, workdir: str | None = None, params: str | None = None,
               expected: ModelConfig | None = None) -> tuple[HybridLM, dict[str, Any]]:
  """Exactly one of `workdir` (newest checkpoint) or `params` (export)."""
  if bool(workdir) == bool(params):
    raise ValueError("give exactly one of --workdir (a training run) or --params (an export)")
  if workdir:
    return load_from_workdir(workdir, expected)
  return load_from_params(params, expected)
