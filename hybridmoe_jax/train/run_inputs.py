"""What a run trains on: the tokenizer of `data.tokenizer`, the train iterator and held-out
batches (`build_data`), the checks every host batch passes (`check_batch`); fingerprinted in
`workdir/inputs.json`, checked on every resume.

A resume with another tokenizer (same vocabulary size: nothing else notices) reads every
saved embedding row as another token: refused unless `train.allow_tokenizer_change`. A
corpus edited in place under `data.paths` changes what the restored data-iterator position
points at: one warning. Raising `train.steps` moves the end of the LR schedule (cosine /
wsd decay): one warning with the old and new schedule ends and the LR at the resumed step.

Fingerprints:
  tokenizer: its class, chat / vision flags, vocabulary size and the sha256 of each of its
    files (a built-in byte tokenizer has none).
  data: per file under data.paths (directories walked in sorted order, globs expanded):
    relative path, size, mtime (ns) and the sha256 of its first and last 64 KiB, hashed
    together; a file edited in place changes its mtime even when its size and ends do not.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Any

from absl import logging
import jax
import numpy as np

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.data import curriculum as data_curriculum
from hybridmoe_jax.data import pipeline as data_pipeline
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers import load as tokenizers_load
from hybridmoe_jax.data.tokenizers.load import fingerprint, make_tokenizer
from hybridmoe_jax.data import vlm_pipeline
from hybridmoe_jax.config.run import RunConfig
from hybridmoe_jax.train import workdir_config
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.cli.errors import InputError

FILE = "inputs.json"
_EDGE = 64 * 1024      # bytes hashed at each end of a data file
_MAX_DATA_FILES = 100_000


class TokenizerChanged(ConfigError):
  """The resumed run's tokenizer is not the one its checkpoints were trained with."""


def _data_files(paths) -> list[str]:
  out = []
  for p in paths:
    if os.path.isdir(p):
      for d, dirs, names in os.walk(p):
        dirs.sort()
        out += [os.path.join(d, n) for n in sorted(names)]
    elif os.path.exists(p):
      out.append(p)
    else:  # a glob (data.paths may hold them, `storage.list_files`), else nothing here
      out += [f for f in sorted(glob.glob(os.path.expanduser(p), recursive=True))
              if os.path.isfile(f)]
    if len(out) > _MAX_DATA_FILES:
      break
  return out[:_MAX_DATA_FILES]


def data_fingerprint(run: RunConfig) -> dict[str, Any]:
  """{"source", "files", "bytes", "digest"} of the files under data.paths."""
  d = run.data
  h = hashlib.sha256(f"{d.source}|{d.jsonl_field}".encode())
  n = total = 0
  for path in _data_files(d.paths):
    try:
      st = os.stat(path)
      with open(path, "rb") as f:
        head = f.read(_EDGE)
        f.seek(max(st.st_size - _EDGE, 0))
        tail = f.read(_EDGE)
    except OSError:  # unreadable: the data pipeline names it; the fingerprint notes it
      h.update(f"{path}|unreadable".encode())
      continue
    h.update(f"{path}|{st.st_size}|{st.st_mtime_ns}|".encode())
    h.update(hashlib.sha256(head + b"|" + tail).digest())
    n, total = n + 1, total + st.st_size
  return {"source": d.source, "files": n, "bytes": total, "digest": h.hexdigest()}


def _read(workdir: str) -> dict[str, Any]:
  try:
    with open(os.path.join(workdir, FILE), encoding="utf-8") as f:
      saved = json.load(f)
    return saved if isinstance(saved, dict) else {}
  except (OSError, ValueError):  # absent (a run of older code) or damaged: nothing to compare
    return {}


def check_and_record(workdir: str, run: RunConfig, tokenizer, *, resumed_at: int | None,
                     saved_config: str | None, schedule=None) -> None:
  """On a resume (`resumed_at`: the restored step), compare with the workdir's record:
  TokenizerChanged for another tokenizer (unless train.allow_tokenizer_change), one warning
  for changed data, one for a changed `train.steps`; then record the current inputs.

  saved_config: the restored checkpoint's config (JSON of the RunConfig), for train.steps.
  schedule: this run's LR schedule (step -> lr), for the warning's figures.
  """
  now = {"tokenizer": fingerprint(tokenizer), "data": data_fingerprint(run)}
  saved = _read(workdir) if resumed_at is not None else {}
  if saved.get("tokenizer") not in (None, now["tokenizer"]):
    before, after = saved["tokenizer"], now["tokenizer"]
    if not run.train.allow_tokenizer_change:
      raise TokenizerChanged(
          f"data.tokenizer = {run.data.tokenizer!r} is another tokenizer than the one the "
          f"checkpoints in {workdir} were trained with ({_describe(before)} then, "
          f"{_describe(after)} now; recorded in {os.path.join(workdir, FILE)}): every "
          "token id would mean another token. Use the original tokenizer, a fresh --workdir, "
          "or --config.train.allow_tokenizer_change=True to continue anyway")
    logging.warning("resuming at step %d with another tokenizer (%s then, %s now): allowed by "
                    "train.allow_tokenizer_change", resumed_at, _describe(before),
                    _describe(after))
  if saved.get("data") not in (None, now["data"]):
    b, a = saved["data"], now["data"]
    logging.warning("the training data under data.paths changed since the checkpoint's run "
                    "(%d files, %d bytes then; %d files, %d bytes now; or edited / touched in "
                    "place): the resumed data position (step %d) refers to the old contents, "
                    "so losses before and after it are not comparable", b.get("files", 0),
                    b.get("bytes", 0), a["files"], a["bytes"], resumed_at)
  if resumed_at is not None:
    _warn_steps_change(saved_config, run, resumed_at, schedule)
  workdir_config.write_json(os.path.join(workdir, FILE), now)


def _describe(t: dict[str, Any]) -> str:
  files = ", ".join(f"{n} sha256 {h[:12]}" for n, h in t.get("files", {}).items())
  return f"{t.get('kind')}{' chat' if t.get('chat') else ''} ({t.get('vocab_size')} ids" + (
      f"; {files})" if files else ")")


def _warn_steps_change(saved_config: str | None, run: RunConfig, step: int, schedule) -> None:
  try:
    old = int(json.loads(saved_config or "{}").get("train", {}).get("steps"))
  except (TypeError, ValueError):
    return
  new = run.train.steps
  if old == new:
    return
  lr = ""
  if schedule is not None:
    try:
      old_run = dataclasses.replace(run, train=dataclasses.replace(run.train, steps=old))
      was = float(plan_lib.build_plan(old_run).schedule()(step))
      lr = f"; the learning rate at step {step} was {was:.3g}, is now {float(schedule(step)):.3g}"
    except Exception:  # pylint: disable=broad-except  # (a curriculum that no longer fits)
      lr = ""
  logging.warning("train.steps changed from %d to %d on resume: the LR schedule (train.schedule"
                  " = %r) now ends at step %d instead of %d%s", old, new, run.train.schedule,
                  new, old, lr)


# Settings that change what the run's numbers mean: a resume with other values is allowed,
# but its losses and evals are no longer comparable with those before it.
SETTINGS_THAT_CHANGE_NUMBERS = {"train": ("batch_size", "seq_len", "grad_accum", "eval_batches", "seed"),
                "data": None, "curriculum": None}  # None: the whole section


def warn_changed_settings(saved_json: str | None, run: RunConfig, step: int) -> None:
  """Log one warning listing the data settings that differ from the restored run's."""
  if not saved_json:
    return
  try:
    saved = json.loads(saved_json)
  except ValueError:
    return
  now = workdir_config.jsonify(dataclasses.asdict(run))
  pick = lambda d, keys: d if keys is None else {k: d.get(k) for k in keys}
  diffs = []
  for section, keys in SETTINGS_THAT_CHANGE_NUMBERS.items():
    diffs += workdir_config.config_diff(pick(saved.get(section, {}), keys),
                                  pick(now.get(section, {}), keys), saved_as="before",
                                  current_as="now", prefix=section)
  if diffs:
    logging.warning("resuming at step %d with other data settings than the checkpoint's run: "
                    "%s; losses and evals before and after step %d are not comparable",
                    step, "; ".join(diffs), step)


def run_tokenizer(run: RunConfig, *, check_vocab: bool = True) -> Tokenizer:
  """The tokenizer of `data.tokenizer` (image roles for a vision model), checked against
  model.vocab_size. Raises InputError (one line naming the file / field) before any compute."""
  try:
    tok = make_tokenizer(run.data.tokenizer, vision=run.model.vision.enabled)
    if check_vocab:
      tokenizers_load.check_vocab(tok, run.model.vocab_size)
  except ValueError as e:
    raise InputError(f"data.tokenizer: {e}" if not str(e).startswith("data.tokenizer")
                     else str(e)) from None
  return tok


def build_data(run: RunConfig, plan: plan_lib.Plan,
               tokenizer: Tokenizer | None = None):
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


def next_batch(it, t, vocab_size: int, step: int) -> dict[str, np.ndarray]:
  try:
    batch = next(it)
  except StopIteration:
    raise InputError(f"the training data ran out at step {step}: the dataset is empty or "
                     "too small for one batch of "
                     f"{t.batch_size} x {t.seq_len} tokens") from None
  check_batch(batch, t, vocab_size, step, getattr(it, "batch_shape", None))
  return batch
