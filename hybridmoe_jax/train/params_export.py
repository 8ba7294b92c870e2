"""Params exports: parameters and routing biases only, plus the model config.

`export_params` writes `path/params.safetensors` (leaf by leaf) and `path/model_config.json`
(+ the tokenizer, through `also`), atomically via `path.partial`; the reader is
`hybridmoe_jax.loading` (`load_exported_params`, `load_into`), which checks it leaf by leaf
against the trees its config builds. The run's full checkpoints are `checkpoint`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable

from absl import logging
from flax import nnx
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from hybridmoe_jax.data import storage
from hybridmoe_jax.io import safetensors
from hybridmoe_jax.config.sharding import path_string
from hybridmoe_jax.cli import io_noise
from hybridmoe_jax.train.checkpoint import CheckpointWriteError
from hybridmoe_jax.train.workdir_config import CONFIG_FILE

PARAMS_FILE = "params.safetensors"


class ExportWriteError(CheckpointWriteError):
  """A params export could not be written; nothing is left at its path."""


def _export_remote(path: str, params, biases, model_dict, also) -> str:
  """export_params to a bucket. One process: a local export, then uploaded (params file
  last). Several: process 0 uploads the config and tokenizer, then every process writes its
  shards of the arrays straight into `path/params/` (one collective orbax save; orbax's
  primary process finalises it, its commit marker last)."""
  multi = jax.process_count() > 1
  code, err = 0, None   # process 0 decides for all: 1 exists, 2 cannot be checked
  if jax.process_index() == 0:
    try:
      code = int(storage.as_path(path).exists())
    except Exception as e:  # pylint: disable=broad-except  # cloud clients raise many kinds
      code, err = 2, e
  if multi:   # before process 0 writes there: no process may see its config as "exists"
    code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
  if code == 1:
    raise FileExistsError(f"--export_params_to={path} exists; refusing to overwrite it")
  if code == 2:
    raise ExportWriteError(str(storage.storage_error(path, err, "write")) if err else
                           f"--export_params_to={path}: process 0 cannot write there")
  with tempfile.TemporaryDirectory(prefix="export_") as tmp:
    local = os.path.join(tmp, "export")
    if multi:
      os.makedirs(local)
      _write_config(local, model_dict, also)
    else:
      export_params(local, params, biases, model_dict, also)
    names = sorted((os.path.relpath(os.path.join(d, n), local)
                    for d, _, files in os.walk(local) for n in files),
                   key=lambda n: (n == PARAMS_FILE, n))
    try:
      if jax.process_index() == 0:
        storage.upload(local, path, names)
      if multi:
        with ocp.StandardCheckpointer() as ckptr:
          ckptr.save(f"{path.rstrip('/')}/params", _tree(params, biases))
    except Exception as e:  # pylint: disable=broad-except
      err = e if isinstance(e, OSError) else storage.storage_error(path, e, "write")
      raise ExportWriteError(f"{err}; the export is incomplete there (no params): rerun to "
                             "a new path") from None
  return path


def _tree(params, biases) -> dict[str, Any]:
  return {"params": nnx.to_pure_dict(params), "routing_biases": nnx.to_pure_dict(biases)}


def _write_config(directory: str, model_dict, also) -> None:
  """model_config.json, and what `also(directory)` adds (the tokenizer)."""
  with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
    json.dump(model_dict, f, indent=1, sort_keys=True, default=list)
  if also is not None:
    also(directory)


def export_params(path: str, params, biases, model_dict: dict[str, Any],
                  also: Callable[[str], None] | None = None) -> str:
  """Write parameters and (frozen) routing biases only, plus the config.

  Format: `path/params.safetensors` holding "params/<leaf path>" and
  "routing_biases/<leaf path>" tensors (leaf paths as `sharding.path_string` writes them),
  written leaf by leaf, and `path/model_config.json`; the layout `hybridmoe_jax.convert`
  maps to Hugging Face. A multi-process run (arrays spread over hosts) keeps the orbax
  format `path/params/` (one collective save), which `loading.load_exported_params` reads too.
  Everything is written into `path.partial`, renamed to `path` when complete; `also(dir)`
  adds files (the tokenizer) before the rename. A write that fails (disk full, quota, file
  size limit) removes the partial directory and raises ExportWriteError (one line).
  A gs:// `path` is written locally first, then uploaded file by file with the params file
  last (each object appears whole), so `loading.is_export` sees it only once it is complete;
  a multi-process run writes `path/params/` in the bucket collectively (`_export_remote`).
  """
  if storage.is_remote(path):
    return _export_remote(path, params, biases, model_dict, also)
  path = os.path.abspath(path)
  if os.path.exists(path):
    raise FileExistsError(f"--export_params_to={path} exists; refusing to overwrite it")
  tmp = path + ".partial"   # renamed to `path` when complete: a failed export leaves no path
  if os.path.exists(tmp):
    logging.warning("removing %s, left by an export that did not finish", tmp)
    shutil.rmtree(tmp)
  tree = _tree(params, biases)
  try:
    if jax.process_count() > 1:
      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(tmp, "params"), tree)
    else:
      os.makedirs(tmp)
      _write_params_file(os.path.join(tmp, PARAMS_FILE), tree)
    _write_config(tmp, model_dict, also)
    os.replace(tmp, path)
  except BaseException as e:
    shutil.rmtree(tmp, ignore_errors=True)
    err = io_noise.os_error(e) if isinstance(e, Exception) else None
    if err is None:
      raise
    what, fix = io_noise.describe_write_error(err)
    raise ExportWriteError(
        f"cannot write the params export {path}: {what} ({err.filename or tmp}); the "
        f"unfinished export was removed and the run's checkpoints are intact. "
        f"{fix[0].upper() + fix[1:]}, then rerun (it restores the last checkpoint and "
        "exports again)") from None
  return path


def _write_params_file(file: str, tree) -> None:
  leaves = [(path_string(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
  specs = [safetensors.Spec(name, safetensors.dtype_code(x.dtype), tuple(x.shape))
           for name, x in leaves]
  writer = safetensors.SafetensorsWriter(file, specs, sparse=False,
                                         metadata={"format": "hybridmoe_jax params export"})
  try:
    for name, x in leaves:
      writer.write(name, [np.asarray(jax.device_get(x))])
    writer.close()
  except BaseException:
    writer.abort()
    raise
