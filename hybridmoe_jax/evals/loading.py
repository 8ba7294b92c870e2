"""Load a trained model for evaluation: the newest checkpoint of a run, or a params export.

Both read what `hybridmoe_jax.train.checkpoint` writes: a run's
`workdir/{model_config.json, checkpoints/<step>/{state, meta}}`, or an export's
`path/{model_config.json, params/}`. Loading is read-only: a checkpoint that fails to restore
or to match its fingerprint is skipped with a warning (the training loop, not an eval, is
the one that quarantines it), so evaluating a live run never moves its files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from hybridmoe_jax.config import ConfigError, ModelConfig, model_config_from_dict
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.sharding import path_string
from hybridmoe_jax.train import checkpoint as ckpt_lib


def _read_config(path: str, what: str) -> dict[str, Any]:
  file = os.path.join(path, ckpt_lib.CONFIG_FILE)
  if not os.path.isfile(file):
    raise ValueError(f"{what} {path} has no {ckpt_lib.CONFIG_FILE}: not a training run "
                     "directory / params export")
  with open(file, encoding="utf-8") as f:
    return json.load(f)


def _check_expected(path: str, saved: dict, expected: ModelConfig | None) -> None:
  """ConfigError if a user-given config differs from the one stored with the weights."""
  if expected is None:
    return
  want = json.loads(json.dumps(dataclasses.asdict(expected), default=list))
  diff = ckpt_lib.config_diff(saved, want)
  if diff:
    raise ConfigError(f"--config does not match the model stored in {path} "
                      f"({ckpt_lib.CONFIG_FILE}): " + "; ".join(
                          d.replace("in the workdir", "stored").replace(" now", " in --config")
                          for d in diff[:6]) + (" ..." if len(diff) > 6 else ""))


def _same(a, b) -> bool:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


def load_from_workdir(workdir: str, expected: ModelConfig | None = None
                      ) -> tuple[HybridLM, dict[str, Any]]:
  """-> (model with the newest good checkpoint's params and routing biases, info).

  Raises:
    ValueError: no run, no checkpoint, or none restorable. ConfigError: the stored
      config differs from `expected` or from the checkpoint's own record.
  """
  # pylint: disable=g-import-not-at-top  (train-only dependencies)
  from hybridmoe_jax.train import optim
  from hybridmoe_jax.train.state import ModelFns, abstract_train_state
  saved = _read_config(workdir, "--workdir")
  _check_expected(workdir, saved, expected)
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    raise ValueError(f"--workdir {workdir} has no checkpoints/ directory")
  manager = ocp.CheckpointManager(directory,
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  steps = sorted(manager.all_steps(), reverse=True)
  if not steps:
    raise ValueError(f"--workdir {workdir} holds no finished checkpoint in {directory}")
  for step in steps:
    try:
      meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("checkpoint %d: unreadable metadata (%s); trying an older one", step, e)
      continue
    ckpt_lib.check_workdir_config(workdir, saved, saved=meta.get("model_config", {}),
                                  source=f"checkpoint step {step}")
    cfg = model_config_from_dict(meta["model_config"])
    root = ml_collections.ConfigDict(json.loads(meta["config"]))
    tx = optim.make_optimizer(root.train)
    # Only the model factory and the bias type shape the state; no bias update is run.
    fns = ModelFns(lambda c, seed, _: HybridLM(c, rngs=nnx.Rngs(seed)), None, RoutingBias)
    graphdef, abstract = abstract_train_state(fns, cfg, tx, 0, "none")
    if meta.get("signature") not in (None, ckpt_lib.structure_signature(abstract)):
      raise ConfigError(f"checkpoint step {step} in {directory} has a train-state layout that "
                        "this code cannot rebuild (model or optimizer structure changed)")
    try:
      state = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract))).state
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("checkpoint %d failed to restore (%s); trying an older one", step,
                      str(e)[:300])
      continue
    if not _same(meta.get("fingerprint", []), ckpt_lib.fingerprint(state)):
      logging.warning("checkpoint %d does not match its fingerprint; trying an older one", step)
      continue
    manager.close()
    model = nnx.merge(graphdef, state.params, state.biases, state.rest)
    return model, {"source": "workdir", "path": workdir, "step": step,
                   "data_config": root.data.to_dict() if "data" in root else None}
  manager.close()
  raise ValueError(f"no checkpoint in {directory} could be restored (see warnings)")


def _flat(tree) -> dict[str, tuple]:
  """{"layers/0/mixer/...": shape}; orbax turns integer keys into strings, so compare as str."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_string(p): tuple(np.shape(x)) for p, x in leaves}


def _mismatch(want, got) -> list[str]:
  want, got = _flat(want), _flat(got)
  out = [f"{k}: missing" for k in sorted(set(want) - set(got))]
  out += [f"{k}: unexpected" for k in sorted(set(got) - set(want))]
  out += [f"{k}: shape {got[k]} in the checkpoint vs {want[k]} from the config"
          for k in sorted(set(want) & set(got)) if want[k] != got[k]]
  return out


def load_from_params(path: str, expected: ModelConfig | None = None
                     ) -> tuple[HybridLM, dict[str, Any]]:
  """-> (model from a params-only export, info). ValueError if arrays and config disagree."""
  saved = _read_config(path, "--params")
  _check_expected(path, saved, expected)
  cfg = model_config_from_dict(saved)
  tree = ckpt_lib.load_exported_params(path)
  abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, biases, rest = nnx.split(abstract, nnx.Param, RoutingBias, ...)
  for name, state in (("params", params), ("routing_biases", biases)):
    want = nnx.to_pure_dict(state)
    bad = _mismatch(want, tree.get(name, {}))
    if bad:
      raise ValueError(f"--params {path}: the stored {name} do not match its "
                       f"{ckpt_lib.CONFIG_FILE}: " + "; ".join(bad[:6])
                       + (" ..." if len(bad) > 6 else ""))
    nnx.replace_by_pure_dict(state, jax.tree.map(jax.numpy.asarray, tree[name]))
  return nnx.merge(graphdef, params, biases, rest), {"source": "params", "path": path}


def load_model(*, workdir: str | None = None, params: str | None = None,
               expected: ModelConfig | None = None) -> tuple[HybridLM, dict[str, Any]]:
  """Exactly one of `workdir` (newest checkpoint) or `params` (export)."""
  if bool(workdir) == bool(params):
    raise ValueError("give exactly one of --workdir (a training run) or --params (an export)")
  if workdir:
    return load_from_workdir(workdir, expected)
  return load_from_params(params, expected)
