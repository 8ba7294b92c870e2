"""Streaming conversion between a Hugging Face Kimi-Linear directory and our params export.

HF directory: config.json, model.safetensors or shards + model.safetensors.index.json, and
tokenizer files. Our params export (`train/checkpoint.py`): params.safetensors (leaf names,
dtypes as stored), model_config.json, and here also hf_config.json (the imported config.json,
whole: exported back unchanged while it describes the model, `hf_config.export_config`) plus
the tokenizer files in tokenizer/ (where runs keep theirs: `data.tokenizers.load.TOKENIZER_DIR`).

Both directions check the whole source against the config first (`hf_weights.check_source`:
one error naming every unknown / missing / mis-shaped tensor), then write tensor by tensor,
each streamed in chunks (`hf_weights.produce`): host memory stays near one input tensor,
never the model. Outputs are written into `<out>.partial` and renamed when complete; an
existing output path is refused. Only the numpy side is imported here: the source of
`to_hf` may also be a training workdir or an old orbax export, loaded (whole, as training
holds it) through `hybridmoe_jax.loading` on demand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from typing import Any, Iterator

import numpy as np

from hybridmoe_jax.config import migrate_legacy, model_config_from_dict
from hybridmoe_jax.convert import hf_config, hf_weights
from hybridmoe_jax.convert.hf_config import CONFIG_JSON, read_hf_config
from hybridmoe_jax.data.tokenizers.load import TOKENIZER_DIR
from hybridmoe_jax.io.safetensors import (DTYPES, CheckpointReader, SafetensorsFile,
                                          ShardedWriter, SafetensorsWriter, Spec, dtype_code)

MODEL_CONFIG = "model_config.json"     # = train.workdir_config.CONFIG_FILE
PARAMS_FILE = "params.safetensors"     # = train.params_export.PARAMS_FILE
HF_EXTRA = "hf_config.json"
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenizer.json",
                   "special_tokens_map.json", "generation_config.json")
# Kept in float32 by `--dtype` casts, as in the released checkpoint (small, precision-critical).
KEEP_F32 = ("A_log", "dt_bias", "e_score_correction_bias")
SHARD_BYTES = 5 * 2**30


class DictSource:
  """In-memory tensors {name: array} with the `Source` interface."""

  @dataclasses.dataclass
  class _Info:
    dtype: str
    shape: tuple[int, ...]

  def __init__(self, tensors: dict[str, np.ndarray]):
    self.tensors = tensors

  def info(self, name):
    a = self.tensors[name]
    return self._Info(dtype_code(a.dtype), tuple(a.shape))

  def read(self, name):
    return np.asarray(self.tensors[name])

  def read_rows(self, name, start, stop):
    return np.asarray(self.tensors[name][start:stop])


def _refuse_existing(path: str) -> None:
  if os.path.exists(path) or os.path.exists(path + ".partial"):
    which = path if os.path.exists(path) else path + ".partial"
    raise FileExistsError(f"output {which} exists; refusing to overwrite it (choose a new "
                          "path, or remove a .partial left by an interrupted conversion)")


def _cast(chunks: Iterator[np.ndarray], dtype: np.dtype) -> Iterator[np.ndarray]:
  for c in chunks:
    yield c if c.dtype == dtype else c.astype(dtype)
    del c   # released before the next chunk is made (a genexpr would keep it alive)


def _write_all(writer, rules, src, specs, *, to: str) -> None:
  dtypes = {s.name: DTYPES[s.dtype] for s in specs}
  for rule, name in hf_weights.outputs(rules, to=to):
    writer.write(name, _cast(hf_weights.produce(rule, name, src, to=to), dtypes[name]))


@contextlib.contextmanager
def _removed_on_failure(tmp: str):
  """Remove the `.partial` directory `tmp` if the block fails (a full disk while writing the
  config or copying the tokenizer too), so that a rerun is not refused by it."""
  try:
    yield
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _write_partial(out_dir: str, make_writer, rules, src, specs, *, to: str) -> str:
  """Every tensor into `<out_dir>.partial` through `make_writer(tmp)`; the directory is
  removed when anything fails (the finished one is renamed by the caller). -> tmp."""
  tmp = out_dir + ".partial"
  os.makedirs(tmp)
  with _removed_on_failure(tmp):
    writer = make_writer(tmp)
    try:
      _write_all(writer, rules, src, specs, to=to)
      writer.close()
    except BaseException:
      writer.abort()
      raise
  return tmp


def _copy_tokenizer(src_dir: str, dst_dir: str) -> list[str]:
  """Copies the tokenizer files of `src_dir` into `dst_dir` (made when there is one).

  HF dirs hold them at the top; our runs and exports in TOKENIZER_DIR, where the evals and
  `hybridmoe_jax.load` read them (`data.tokenizers.load.tokenizer_from_dir`)."""
  copied = []
  for name in TOKENIZER_FILES:
    path = os.path.join(src_dir, name)
    if os.path.isfile(path):
      os.makedirs(dst_dir, exist_ok=True)
      shutil.copy2(path, os.path.join(dst_dir, name))
      copied.append(name)
  return copied


def _json(path: str, obj) -> None:
  with open(path, "x", encoding="utf-8") as f:
    json.dump(obj, f, indent=1, sort_keys=True)


def from_hf(hf_dir: str, out_dir: str, *, sparse: bool = True) -> dict[str, Any]:
  """Convert a Kimi-Linear HF directory into our params export at `out_dir`.

  Returns a summary: tensors, bytes, the largest tensor's bytes and the copied tokenizer
  files. Raises UnsupportedConfig / TensorMismatch / FileExistsError before writing.
  sparse: all-zero chunks become holes in the output file.
  """
  out_dir = os.path.abspath(out_dir)
  _refuse_existing(out_dir)
  hf = read_hf_config(hf_dir)
  cfg = hf_config.model_config_from_hf(hf)
  rules = hf_weights.weight_rules(cfg)
  with CheckpointReader(hf_dir) as reader:
    specs = hf_weights.check_source(rules, reader, reader.tensors, to="ours", where=hf_dir)
    tmp = _write_partial(out_dir, lambda tmp: SafetensorsWriter(
        os.path.join(tmp, PARAMS_FILE), specs, sparse=sparse,
        metadata={"format": "hybridmoe_jax params export",
                  "source": "huggingface kimi_linear"}), rules, reader, specs, to="ours")
  with _removed_on_failure(tmp):
    _json(os.path.join(tmp, MODEL_CONFIG), hf_config.model_dict(cfg))
    _json(os.path.join(tmp, HF_EXTRA), hf)
    copied = _copy_tokenizer(hf_dir, os.path.join(tmp, TOKENIZER_DIR))
    os.replace(tmp, out_dir)
  return _summary(specs, out_dir, copied)


def _summary(specs: list[Spec], out: str, copied: list[str]) -> dict[str, Any]:
  return {"out": out, "tensors": len(specs), "bytes": sum(s.nbytes for s in specs),
          "largest_tensor_bytes": max(s.nbytes for s in specs), "tokenizer_files": copied}


def _read_model_config(path: str):
  file = os.path.join(path, MODEL_CONFIG)
  with open(file, encoding="utf-8") as f:
    saved = json.load(f)
  return model_config_from_dict(migrate_legacy({"model": saved})["model"])


def _our_source(src_dir: str):
  """(ModelConfig, Source, tensor names, closer) of an export or a training workdir."""
  params_file = os.path.join(src_dir, PARAMS_FILE)
  if os.path.isfile(params_file):
    f = SafetensorsFile(params_file)
    return _read_model_config(src_dir), f, list(f.tensors), f.close
  if not os.path.isfile(os.path.join(src_dir, MODEL_CONFIG)):
    raise FileNotFoundError(f"{src_dir} has no {MODEL_CONFIG}: not one of our params exports "
                            "or training workdirs")
  # A training workdir or an orbax-era export: restored whole (as training holds it).
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from hybridmoe_jax import loading  # pylint: disable=import-outside-toplevel
  from hybridmoe_jax.config.sharding import path_string  # pylint: disable=import-outside-toplevel
  from hybridmoe_jax.train.state import split_model  # pylint: disable=import-outside-toplevel

  is_run = os.path.isdir(os.path.join(src_dir, "checkpoints"))
  model, _ = loading.load_model(**{"workdir" if is_run else "params": src_dir})
  _, params, biases, _ = split_model(model)
  tensors = {}
  for prefix, tree in ((hf_weights.P, params), (hf_weights.B, biases)):
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0]:
      tensors[prefix + path_string(path)] = np.asarray(jax.device_get(leaf))
  return model.cfg, DictSource(tensors), list(tensors), lambda: None


def to_hf(src_dir: str, out_dir: str, *, dtype: str | None = None, sparse: bool = True,
          shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
  """Export one of our params exports (or a training workdir) as a Kimi-Linear HF dir.

  dtype: None keeps each tensor's stored dtype; "float32" / "bfloat16" / "float16" casts
    the weights (A_log, dt_bias and the correction bias stay float32, as released).
  Raises UnsupportedConfig naming the first field HF Kimi-Linear cannot express.
  """
  allowed = (None, "float32", "bfloat16", "float16")
  if dtype not in allowed:
    raise ValueError(f"--dtype={dtype!r} is invalid: allowed float32, bfloat16, float16 or "
                     "unset (keep)")
  out_dir = os.path.abspath(out_dir)
  _refuse_existing(out_dir)
  cfg, src, names, close = _our_source(src_dir)
  try:
    extra = {}
    extra_file = os.path.join(src_dir, HF_EXTRA)
    if os.path.isfile(extra_file):
      with open(extra_file, encoding="utf-8") as f:
        extra = json.load(f)
    hf = hf_config.export_config(cfg, extra)
    rules = hf_weights.weight_rules(cfg)
    specs = hf_weights.check_source(rules, src, names, to="hf", where=src_dir)
    if dtype is not None:
      code = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[dtype]
      specs = [s if s.name.endswith(KEEP_F32) else s._replace(dtype=code) for s in specs]
    tmp = _write_partial(out_dir, lambda tmp: ShardedWriter(
        tmp, specs, prefix="model", max_shard_bytes=shard_bytes, sparse=sparse,
        metadata={"format": "pt"}), rules, src, specs, to="hf")
  finally:
    close()
  with _removed_on_failure(tmp):
    _json(os.path.join(tmp, CONFIG_JSON), hf)
    copied = _copy_tokenizer(os.path.join(src_dir, TOKENIZER_DIR), tmp)
    os.replace(tmp, out_dir)
  return _summary(specs, out_dir, copied)

