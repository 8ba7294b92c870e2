"""orbax checkpoints of the whole run: train state, data-iterator state and metadata.

Layout: `workdir/checkpoints/<step>/{state, data, meta}`. orbax writes each step into a
temporary directory and renames it when complete (atomic); `keep` bounds how many stay.
Restore walks back from the newest step: a checkpoint that fails to load or whose
fingerprint (per-leaf sums recorded at save time) does not match is reported, moved to
`workdir/checkpoints_corrupt/` (never deleted or overwritten) and the previous one is tried.
`meta` holds the model config: a workdir from an incompatible config stops the run.
Sharded states are saved collectively (every process calls `save`; orbax writes each shard
once) and restored onto whatever shardings the abstract target carries, so a run may resume
on a different mesh (`parallel.runtime.Runtime.restore_target`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging as std_logging
import os
import shutil
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from hybridmoe_jax.config import ConfigError, ModelConfig
from hybridmoe_jax.parallel.distributed import gather_host_states, own_host_state

CONFIG_FILE = "model_config.json"
# Model fields that change how a step computes but not what the state holds: a workdir may be
# resumed with new values (with a warning). Every other model field must match.
RUNTIME_FIELDS = ("model.dtype", "model.kda.impl", "model.kda.chunk_size",
                  "model.moe.balancing", "model.moe.qb_num_bins", "model.moe.sign_gamma",
                  "model.moe.capacity_factor")


class _QuietOrbax(std_logging.Filter):
  """Drop orbax's INFO chatter (dozens of lines per save); keep its warnings and errors."""

  def filter(self, record) -> bool:
    return record.levelno >= 30 or "orbax" not in record.pathname


def _quiet_orbax_logs() -> None:
  absl_logger = logging.get_absl_logger()
  if not any(isinstance(f, _QuietOrbax) for f in absl_logger.filters):
    absl_logger.addFilter(_QuietOrbax())


@jax.jit
def _leaf_sums(tree) -> jax.Array:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.number)]
  if not leaves:
    return jnp.zeros((0,), jnp.float32)
  return jnp.stack([jnp.sum(x.astype(jnp.float32)) for x in leaves])


def fingerprint(tree) -> list[float]:
  """Per-leaf sums (float32): cheap evidence that restored arrays are what was saved."""
  return [float(v) for v in np.asarray(_leaf_sums(tree))]


def _same_fingerprint(a, b) -> bool:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


def structure_signature(abstract_state) -> str:
  """Tree structure plus leaf shapes/dtypes: equal iff a checkpoint can be restored into it."""
  leaves = [f"{tuple(x.shape)}:{x.dtype}" for x in jax.tree.leaves(abstract_state)]
  text = f"{jax.tree.structure(abstract_state)}|{','.join(leaves)}"
  return hashlib.sha256(text.encode()).hexdigest()


def _jsonify(d):
  return json.loads(json.dumps(d, default=list))


def config_diff(saved: dict, current: dict, prefix: str = "model") -> list[str]:
  """Human-readable differences between two (nested) config dicts."""
  out = []
  for key in sorted(set(saved) | set(current)):
    a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
      out += config_diff(a, b, f"{prefix}.{key}")
    elif a != b:
      out.append(f"{prefix}.{key}: {a!r} in the workdir vs {b!r} now")
  return out


def _fill_absent(saved: dict, defaults: dict) -> dict:
  """`saved` with the fields it lacks (added to the config after it was written) defaulted."""
  out = dict(saved)
  for key, value in defaults.items():
    if key not in out:
      out[key] = value
    elif isinstance(out[key], dict) and isinstance(value, dict):
      out[key] = _fill_absent(out[key], value)
  return out


def check_workdir_config(workdir: str, model_dict: dict[str, Any], *, source: str | None = None,
                         saved: dict | None = None) -> None:
  """Raise ConfigError if the workdir's stored model config differs from `model_dict`."""
  path = os.path.join(workdir, CONFIG_FILE)
  if saved is None:
    if not os.path.exists(path):
      return
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    source = path
  # A run saved before a config field existed used that field's default (e.g. no vision).
  saved = _fill_absent(_jsonify(saved), _jsonify(dataclasses.asdict(ModelConfig())))
  diff = config_diff(saved, _jsonify(model_dict))
  soft = [d for d in diff if d.split(":")[0] in RUNTIME_FIELDS]
  if soft:
    logging.warning("resuming with changed runtime settings: %s", "; ".join(soft))
  diff = [d for d in diff if d not in soft]
  if diff:
    raise ConfigError(
        f"workdir {workdir} holds a run of an incompatible model config ({source}): "
        + "; ".join(diff[:8]) + (" ..." if len(diff) > 8 else "")
        + ". Use a fresh --workdir or the original config.")


def write_workdir_config(workdir: str, model_dict: dict[str, Any]) -> None:
  path = os.path.join(workdir, CONFIG_FILE)
  if os.path.exists(path):
    return
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(_jsonify(model_dict), f, indent=1, sort_keys=True)
  os.replace(tmp, path)


class Checkpointer:
  """Saves and restores (state, data-iterator state, meta) under workdir/checkpoints."""

  def __init__(self, workdir: str, *, keep: int, async_save: bool = True):
    self.workdir = workdir
    self.directory = os.path.join(workdir, "checkpoints")
    self.corrupt_dir = os.path.join(workdir, "checkpoints_corrupt")
    _quiet_orbax_logs()
    os.makedirs(self.directory, exist_ok=True)
    self._quarantine_partial()
    options = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                           enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  # ----------------------------------------------------------------------------- save
  def save(self, step: int, state, data_state: dict[str, Any] | None,
           meta: dict[str, Any]) -> bool:
    """Start saving `step` (async); returns False if that step already exists."""
    if step in self.manager.all_steps():
      return False
    if jax.default_backend() == "cpu":
      # On CPU orbax's "host copy" may alias the device buffers, which the next (donating)
      # train step reuses while the background write still reads them: save a copy.
      state = jax.tree.map(jnp.copy, state)
    meta = {**meta, "step": step, "fingerprint": fingerprint(state), "time": time.time()}
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=ocp.args.JsonSave(gather_host_states(data_state or {})),
                              meta=ocp.args.JsonSave(_jsonify(meta)))
    self.manager.save(step, args=args, force=True)
    return True

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  # ----------------------------------------------------------------------------- restore
  def read_meta(self, step: int) -> dict[str, Any]:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore_latest(self, abstract_state, model_dict: dict[str, Any], signature: str):
    """-> (state, data_state, meta) of the newest good checkpoint, or None if there is none.

    Raises ConfigError when the newest readable checkpoint comes from another model config
    or state layout (e.g. a different optimizer): nothing is restored or moved then.
    """
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        meta = self.read_meta(step)
      except Exception as e:  # pylint: disable=broad-except
        self._quarantine(step, f"unreadable metadata ({type(e).__name__}: {e})")
        continue
      check_workdir_config(self.workdir, model_dict, saved=meta.get("model_config", {}),
                           source=f"checkpoint step {step}")
      if meta.get("signature") not in (None, signature):
        raise ConfigError(
            f"checkpoint step {step} in {self.directory} has a different train-state layout "
            "(model, optimizer or clipping changed: train.optimizer / train.clip). "
            "Use a fresh --workdir or the original config.")
      try:
        r = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        self._quarantine(step, f"{type(e).__name__}: {str(e)[:300]}")
        continue
      if not _same_fingerprint(meta.get("fingerprint", []), fingerprint(r.state)):
        self._quarantine(step, "restored values do not match the fingerprint saved with them")
        continue
      logging.info("restored checkpoint step %d from %s", step, self.directory)
      return r.state, own_host_state(r.data), meta
    return None

  def _quarantine(self, step: int, why: str) -> None:
    os.makedirs(self.corrupt_dir, exist_ok=True)
    src = os.path.join(self.directory, str(step))
    dst = os.path.join(self.corrupt_dir, f"{step}-{int(time.time() * 1000)}")
    logging.warning("checkpoint step %d is corrupt or partial (%s); moved to %s, trying the "
                    "previous one", step, why, dst)
    shutil.move(src, dst)
    self.manager.reload()

  def _quarantine_partial(self) -> None:
    """Move aside unfinished temporary step directories left by a killed save."""
    for name in sorted(os.listdir(self.directory)):
      if ".orbax-checkpoint-tmp" in name:
        os.makedirs(self.corrupt_dir, exist_ok=True)
        dst = os.path.join(self.corrupt_dir, f"{name}-{int(time.time() * 1000)}")
        logging.warning("found a partial checkpoint %s (a save was interrupted); moved to %s",
                        name, dst)
        shutil.move(os.path.join(self.directory, name), dst)


def export_params(path: str, params, biases, model_dict: dict[str, Any]) -> str:
  """Write parameters and (frozen) routing biases only, as plain dicts, plus the config."""
  path = os.path.abspath(path)
  if os.path.exists(path):
    raise FileExistsError(f"--export_params_to={path} exists; refusing to overwrite it")
  tree = {"params": nnx.to_pure_dict(params), "routing_biases": nnx.to_pure_dict(biases)}
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(os.path.join(path, "params"), tree)
  with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
    json.dump(_jsonify(model_dict), f, indent=1, sort_keys=True)
  return path


def load_exported_params(path: str):
  """-> {"params": ..., "routing_biases": ...} plain dicts of numpy arrays."""
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(os.path.join(os.path.abspath(path), "params"))
