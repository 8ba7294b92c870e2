"""Params exports: parameters and routing biases only, plus the model config.

`export_params` writes `path/params.safetensors` (leaf by leaf) and `path/model_config.json`
(+ the tokenizer, through `also`), atomically via `path.partial`; `load_exported_params`
reads it back (or an older / multi-process export's orbax `params/`), checked leaf by leaf
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
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from hybridmoe_jax.data import storage
from hybridmoe_jax.io import safetensors
from hybridmoe_jax.model.stack import layout_hint
from hybridmoe_jax.config.sharding import path_string
from hybridmoe_jax.cli import io_noise
from hybridmoe_jax.train.checkpoint import CONFIG_FILE, CheckpointWriteError

PARAMS_FILE = "params.safetensors"


class ExportWriteError(CheckpointWriteError):
  """A params export could not be written; nothing is left at its path."""


def _flat_leaves(tree) -> list[tuple[str, Any]]:
  return [(path_string(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _export_remote(path: str, params, biases, model_dict, also) -> str:
  """export_params to a bucket: a local export, then uploaded (params file last)."""
  if jax.process_count() > 1:
    raise ExportWriteError(f"--export_params_to={path}: a multi-process run exports to a "
                           "local or mounted directory only; copy it to the bucket after")
  dst = storage.as_path(path)
  try:
    if dst.exists():
      raise FileExistsError(f"--export_params_to={path} exists; refusing to overwrite it")
  except FileExistsError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # cloud clients raise many kinds
    raise ExportWriteError(str(storage.storage_error(path, e, "write"))) from None
  with tempfile.TemporaryDirectory(prefix="export_") as tmp:
    local = export_params(os.path.join(tmp, "export"), params, biases, model_dict, also)
    names = sorted((os.path.relpath(os.path.join(d, n), local)
                    for d, _, files in os.walk(local) for n in files),
                   key=lambda n: (n == PARAMS_FILE, n))
    try:
      fs, root = storage.fsspec_for(path)
      for name in names:
        fs.put_file(os.path.join(local, name), f"{root}/{name}")
      fs.invalidate_cache()
    except Exception as e:  # pylint: disable=broad-except
      raise ExportWriteError(f"{storage.storage_error(path, e, 'write')}; the export is "
                             "incomplete there (no params file): rerun to a new path") from None
  return path


def export_params(path: str, params, biases, model_dict: dict[str, Any],
                  also: Callable[[str], None] | None = None) -> str:
  """Write parameters and (frozen) routing biases only, plus the config.

  Format: `path/params.safetensors` holding "params/<leaf path>" and
  "routing_biases/<leaf path>" tensors (leaf paths as `sharding.path_string` writes them),
  written leaf by leaf, and `path/model_config.json`; the layout `hybridmoe_jax.convert`
  maps to Hugging Face. A multi-process run (arrays spread over hosts) keeps the orbax
  format `path/params/` (one collective save), which `load_exported_params` reads too.
  Everything is written into `path.partial`, renamed to `path` when complete; `also(dir)`
  adds files (the tokenizer) before the rename. A write that fails (disk full, quota, file
  size limit) removes the partial directory and raises ExportWriteError (one line).
  A gs:// `path` is written locally first, then uploaded file by file with the params file
  last (each object appears whole), so `is_export` sees it only once it is complete.
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
  tree = {"params": nnx.to_pure_dict(params), "routing_biases": nnx.to_pure_dict(biases)}
  try:
    if jax.process_count() > 1:
      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(tmp, "params"), tree)
    else:
      os.makedirs(tmp)
      _write_params_file(os.path.join(tmp, PARAMS_FILE), tree)
    with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
      json.dump(model_dict, f, indent=1, sort_keys=True, default=list)
    if also is not None:
      also(tmp)
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
  leaves = _flat_leaves(tree)
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


def nest(flat: dict[str, Any]) -> dict[str, Any]:
  """{"a/b/c": x} -> {"a": {"b": {"c": x}}}: leaf names (`sharding.path_string`) back into
  the nested plain dicts `nnx.replace_by_pure_dict` takes (keys stay strings)."""
  tree: dict[str, Any] = {}
  for name, x in flat.items():
    *parents, leaf = name.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = x
  return tree


def _read_safetensors_export(file: str, expected: dict[str, Any] | None) -> dict[str, Any]:
  """params.safetensors -> nested plain dicts of numpy arrays (string keys, as orbax gave);
  with `expected`, each leaf is cast to the expected leaf's dtype (a converted checkpoint
  may store bfloat16)."""
  want = {f"{name}/{k}": x for name, sub in (expected or {}).items()
          for k, x in _flat_leaves(sub)}
  flat: dict[str, Any] = {}
  with safetensors.SafetensorsFile(file) as f:
    for name in f.tensors:
      x = f.read(name)
      flat[name] = x.astype(want[name].dtype, copy=False) if name in want else x
  return nest(flat)


def _leaf_shapes(tree) -> dict[str, tuple[int, ...]]:
  """{"layers/0/mixer/...": shape}; orbax turns integer keys into strings, so compare as str."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_string(p): tuple(np.shape(x)) for p, x in leaves}


def tree_mismatch(want, got) -> list[str]:
  """Every leaf missing from `got`, unexpected in it, or of another shape than in `want`."""
  want, got = _leaf_shapes(want), _leaf_shapes(got)
  out = [f"{k}: missing" for k in sorted(set(want) - set(got))]
  out += [f"{k}: unexpected" for k in sorted(set(got) - set(want))]
  out += [f"{k}: shape {got[k]} stored vs {want[k]} from the config"
          for k in sorted(set(want) & set(got)) if want[k] != got[k]]
  return out


def is_export(path: str) -> bool:
  """Whether directory `path` holds an export's arrays (params.safetensors, or params/)."""
  return (os.path.isfile(os.path.join(path, PARAMS_FILE))
          or os.path.isdir(os.path.join(path, "params")))


def load_into(path: str, params: nnx.State, biases: nnx.State) -> None:
  """The export at `path` read into `params` and `biases` (nnx States, replaced in place),
  every leaf checked against theirs (`load_exported_params`' ValueError)."""
  tree = load_exported_params(path, expected={
      "params": nnx.to_pure_dict(params), "routing_biases": nnx.to_pure_dict(biases)})
  nnx.replace_by_pure_dict(params, jax.tree.map(jnp.asarray, tree["params"]))
  nnx.replace_by_pure_dict(biases, jax.tree.map(jnp.asarray, tree["routing_biases"]))


def load_exported_params(path: str, expected: dict[str, Any] | None = None):
  """-> {"params": ..., "routing_biases": ...} plain dicts of numpy arrays, from
  params.safetensors (or an older export's orbax `params/`).

  expected: the same two trees (arrays or jax.ShapeDtypeStruct) built from the export's
    config; ValueError listing every missing, unexpected or mis-shaped leaf.
  """
  path = os.path.abspath(path)
  file = os.path.join(path, PARAMS_FILE)
  if os.path.isfile(file):
    tree = _read_safetensors_export(file, expected)
  else:  # an export written before params.safetensors (or by a multi-process run)
    with ocp.StandardCheckpointer() as ckptr:
      tree = ckptr.restore(os.path.join(path, "params"))
  for name, want in (expected or {}).items():
    bad = tree_mismatch(want, tree.get(name, {}))
    if bad:
      raise ValueError(f"params export {path}: the stored {name} do not match its "
                       f"{CONFIG_FILE}: " + "; ".join(bad[:6]) + (" ..." if len(bad) > 6 else "")
                       + layout_hint(want, tree.get(name, {})))
  return tree
