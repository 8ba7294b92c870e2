"""The one model loader: a training workdir (its newest good checkpoint), a params export
or a converted Hugging Face dir -> (HybridLM, tokenizer, info); `detect_layout` tells them
apart by their files. `load(path)` is what `hybridmoe_jax.load` (and so the server) builds
on; `load_model(workdir= | params=)` the command lines' form; `load_into` /
`load_exported_params` read an export's arrays (RL starts from one). Each takes gs:// too:
the run's or export's files are mirrored into the local cache first (`local_dir`). Read-only:
a checkpoint that fails to restore is skipped with a warning and left in place (training, not
a reader, quarantines it), so evaluating or serving a live run never moves its files.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, ModelConfig, migrate_legacy, model_config_from_dict
from hybridmoe_jax.config.run import RunConfig, run_config_from_dict
from hybridmoe_jax.config.sharding import path_string
from hybridmoe_jax.convert import hf_config, hf_weights
from hybridmoe_jax.data import storage
from hybridmoe_jax.data.tokenizers.load import TOKENIZER_DIR, check_vocab, tokenizer_from_dir
from hybridmoe_jax.io import safetensors
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.stack import layout_hint
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import optim, remote_workdir
from hybridmoe_jax.train.params_export import PARAMS_FILE
from hybridmoe_jax.train.state import abstract_train_state, split_model
from hybridmoe_jax.train.workdir_config import CONFIG_FILE, check_model_config, read_model_config

LAYOUTS = (f"a training workdir ({CONFIG_FILE} + checkpoints/), a params export "
           f"({CONFIG_FILE} + {PARAMS_FILE}, or params/ from older versions) or a Hugging "
           "Face dir (config.json + *.safetensors)")


# ---------------------------------------------------------------------------- layouts
def local_dir(path: str) -> str:
  """`path`, or for a gs:// run or export its local mirror (`storage.mirror`, in the cache:
  the export's files, or the run's small files; a run's checkpoints stay in the bucket and
  are read there through its checkpoints.url)."""
  if not storage.is_remote(path):
    return path
  return storage.mirror(path, skip=remote_workdir.NOT_STAGED, what="run or params export")


def detect_layout(path: str) -> str:
  """"workdir", "params" or "hf", from the files in `path`.

  Raises:
    FileNotFoundError: `path` does not exist. ValueError: it is none of the three layouts
      (the message lists what each needs).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"load: path {path} does not exist (expected {LAYOUTS})")
  if not os.path.isdir(path):
    raise ValueError(f"load: path {path} is a file, not a directory (expected {LAYOUTS})")
  has = lambda name: os.path.exists(os.path.join(path, name))  # noqa: E731
  if has(CONFIG_FILE) and is_export(path):
    return "params"
  if has(CONFIG_FILE) and (os.path.isdir(os.path.join(path, "checkpoints"))
                           or has(ckpt_lib.LOCATION_FILE)):   # checkpoints in a bucket
    return "workdir"
  if has(hf_config.CONFIG_JSON) and glob.glob(os.path.join(glob.escape(path), "*.safetensors")):
    return "hf"
  present = sorted(os.listdir(path))[:8]
  raise ValueError(f"load: {path} holds none of the known layouts: expected {LAYOUTS}; "
                   f"found {present or 'an empty directory'}")


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
  if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
    raise ValueError(f"{what} {path} has no {CONFIG_FILE}: not a training run "
                     "directory / params export")


def load(path: str) -> tuple[HybridLM, Any, dict[str, Any]]:
  """Any of the three layouts -> (model, tokenizer, info with "layout").

  The tokenizer is the one stored with the model (`<path>/tokenizer/` of a run or export,
  the top of an HF dir), the byte tokenizer when there is none (with the image ids when the
  model has a vision tower).

  Raises:
    FileNotFoundError / ValueError: a missing path or an unknown layout (one line, before
      anything is read); the layout's own errors (no checkpoint, a config that does not
      match the arrays, an unsupported HF config); TokenizerError: a stored tokenizer file
      cannot be read; ValueError: its ids do not fit the model's embedding.
  """
  path = local_dir(path)
  layout = detect_layout(path)
  if layout == "hf":
    model, info = load_hf_model(path)
  else:
    model, info = load_model(**{layout: path})
  where = path if layout == "hf" else os.path.join(path, TOKENIZER_DIR)
  tokenizer = tokenizer_from_dir(where, vision=model.cfg.vision.enabled)
  check_vocab(tokenizer, model.cfg.vocab_size)
  return model, tokenizer, dict(info, layout=layout)


# ----------------------------------------------------------------- runs and exports
def _read_config(path: str, what: str) -> dict[str, Any]:
  check_model_dir(path, what)
  saved = read_model_config(path)
  if saved is None:
    raise ValueError(f"{what} {path}: {CONFIG_FILE} cannot be read")
  return saved


def _check_expected(path: str, saved: dict, expected: ModelConfig | None) -> None:
  """ConfigError if a user-given config differs from the one stored with the weights."""
  if expected is not None:
    check_model_config(
        saved, dataclasses.asdict(expected), saved_as="stored", current_as="in --config",
        what=f"--config does not match the model stored in {path} ({CONFIG_FILE})")


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
                 "data_config": _saved_run(meta).data,
                 "run_config": json.loads(meta["config"])}   # as saved (not migrated)


def load_from_params(path: str, expected: ModelConfig | None = None
                     ) -> tuple[HybridLM, dict[str, Any]]:
  """-> (model from a params-only export, info). ValueError if arrays and config disagree."""
  saved = _read_config(path, "--params")
  _check_expected(path, saved, expected)
  cfg = model_config_from_dict(saved)
  abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, biases, rest = split_model(abstract)
  load_into(path, params, biases)
  return nnx.merge(graphdef, params, biases, rest), {"source": "params", "path": path}


def load_model(*, workdir: str | None = None, params: str | None = None,
               expected: ModelConfig | None = None) -> tuple[HybridLM, dict[str, Any]]:
  """Exactly one of `workdir` (newest checkpoint) or `params` (export)."""
  if bool(workdir) == bool(params):
    raise ValueError("give exactly one of --workdir (a training run) or --params (an export)")
  if workdir:
    return load_from_workdir(local_dir(workdir), expected)
  return load_from_params(local_dir(params), expected)


# ------------------------------------------------------------------- export readers
def is_export(path: str) -> bool:
  """Whether directory `path` holds an export's arrays (params.safetensors, or params/)."""
  return (os.path.isfile(os.path.join(path, PARAMS_FILE))
          or os.path.isdir(os.path.join(path, "params")))


def nest(flat: dict[str, Any]) -> dict[str, Any]:
  """{"a/b/c": x} -> {"a": {"b": {"c": x}}}: leaf names (`sharding.path_string`) back into
  the nested plain dicts `nnx.replace_by_pure_dict` takes (keys stay strings).

  Raises:
    ValueError: a name that is both a leaf and a prefix of another ("a/b" and "a/b/c": a
      damaged or hand-made file), naming it.
  """
  tree: dict[str, Any] = {}
  for name, x in flat.items():
    *parents, leaf = name.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {}) if isinstance(node, dict) else None
    if not isinstance(node, dict) or isinstance(node.get(leaf), dict):
      raise ValueError(f"tensor {name!r}: its name is also a prefix of another tensor's "
                       "name, or has one as its own prefix (a damaged or hand-made file)")
    node[leaf] = x
  return tree


def _leaves(tree) -> dict[str, Any]:
  """{"layers/0/mixer/...": leaf}; orbax turns integer keys into strings, so names compare
  as strings."""
  return {path_string(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _read_safetensors_export(file: str, expected: dict[str, Any] | None) -> dict[str, Any]:
  """params.safetensors -> nested plain dicts of numpy arrays (string keys, as orbax gave);
  with `expected`, each leaf is cast to the expected leaf's dtype (a converted checkpoint
  may store bfloat16)."""
  want = {f"{name}/{k}": x for name, sub in (expected or {}).items()
          for k, x in _leaves(sub).items()}
  flat: dict[str, Any] = {}
  with safetensors.SafetensorsFile(file) as f:
    for name in f.tensors:
      x = f.read(name)
      flat[name] = x.astype(want[name].dtype, copy=False) if name in want else x
  return nest(flat)


def tree_mismatch(want, got) -> list[str]:
  """Every leaf missing from `got`, unexpected in it, or of another shape than in `want`."""
  want = {k: tuple(np.shape(x)) for k, x in _leaves(want).items()}
  got = {k: tuple(np.shape(x)) for k, x in _leaves(got).items()}
  out = [f"{k}: missing" for k in sorted(set(want) - set(got))]
  out += [f"{k}: unexpected" for k in sorted(set(got) - set(want))]
  out += [f"{k}: shape {got[k]} stored vs {want[k]} from the config"
          for k in sorted(set(want) & set(got)) if want[k] != got[k]]
  return out


def restore_on_one_device(directory: str):
  """An orbax tree (StandardSave) restored onto this process's default device, whatever mesh
  or processes wrote it (orbax refuses the saving topology's shardings on another device
  set) -> nested dicts of arrays."""
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with ocp.StandardCheckpointer() as ckptr:
    stored = ckptr.metadata(directory).item_metadata
    return ckptr.restore(directory, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), stored))


def load_exported_params(path: str, expected: dict[str, Any] | None = None):
  """-> {"params": ..., "routing_biases": ...} plain dicts of numpy arrays, from
  params.safetensors (or an older export's orbax `params/`).

  expected: the same two trees (arrays or jax.ShapeDtypeStruct) built from the export's
    config; ValueError listing every missing, unexpected or mis-shaped leaf.
  """
  path = os.path.abspath(local_dir(path))
  file = os.path.join(path, PARAMS_FILE)
  if os.path.isfile(file):
    tree = _read_safetensors_export(file, expected)
  else:  # an export written before params.safetensors (or by a multi-process run)
    tree = restore_on_one_device(os.path.join(path, "params"))
  for name, want in (expected or {}).items():
    bad = tree_mismatch(want, tree.get(name, {}))
    if bad:
      raise ValueError(f"params export {path}: the stored {name} do not match its "
                       f"{CONFIG_FILE}: " + "; ".join(bad[:6]) + (" ..." if len(bad) > 6 else "")
                       + layout_hint(want, tree.get(name, {})))
  return tree


def load_into(path: str, params: nnx.State, biases: nnx.State) -> None:
  """The export at `path` read into `params` and `biases` (nnx States, replaced in place),
  every leaf checked against theirs (`load_exported_params`' ValueError)."""
  tree = load_exported_params(path, expected={
      "params": nnx.to_pure_dict(params), "routing_biases": nnx.to_pure_dict(biases)})
  nnx.replace_by_pure_dict(params, jax.tree.map(jnp.asarray, tree["params"]))
  nnx.replace_by_pure_dict(biases, jax.tree.map(jnp.asarray, tree["routing_biases"]))


# -------------------------------------------------------------------- Hugging Face
def iter_our_tensors(hf_dir: str) -> Iterator[tuple[str, np.ndarray]]:
  """(our export name, array as stored) for every tensor of an HF dir, one at a time."""
  cfg = hf_config.model_config_from_hf(hf_config.read_hf_config(hf_dir))
  rules = hf_weights.weight_rules(cfg)
  with safetensors.CheckpointReader(hf_dir) as reader:
    specs = hf_weights.check_source(rules, reader, reader.tensors, to="ours", where=hf_dir)
    shapes = {s.name: s.shape for s in specs}
    for rule, name in hf_weights.outputs(rules, to="ours"):
      parts = [c.reshape(-1) for c in hf_weights.produce(rule, name, reader, to="ours")]
      yield name, np.concatenate(parts).reshape(shapes[name])


def load_hf_model(path: str, compute: ComputeConfig | None = None
                  ) -> tuple[HybridLM, dict[str, Any]]:
  """A Kimi-Linear HF dir -> (HybridLM with its weights, info), in memory.

  The weights go through the converter's rules (`convert.hf_weights`), one tensor at a
  time, cast to our float32 parameters; the correction biases become the routing-bias
  state. info: {"source": "huggingface", "path", "hf_config" (the config.json dict)}.
  Raises UnsupportedConfig / TensorMismatch (naming fields / tensors) before building.
  """
  hf = hf_config.read_hf_config(path)
  cfg = hf_config.model_config_from_hf(hf)
  compute = compute or ComputeConfig()
  abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute))
  graphdef, params, biases, rest = split_model(abstract)
  flat = {hf_weights.P: {}, hf_weights.B: {}}
  for name, value in iter_our_tensors(path):
    prefix = hf_weights.P if name.startswith(hf_weights.P) else hf_weights.B
    flat[prefix][name[len(prefix):]] = jnp.asarray(value.astype(np.float32))
  nnx.replace_by_pure_dict(params, nest(flat[hf_weights.P]))
  nnx.replace_by_pure_dict(biases, nest(flat[hf_weights.B]))
  model = nnx.merge(graphdef, params, biases, rest)
  return model, {"source": "huggingface", "path": os.path.abspath(path), "hf_config": hf}
