"""orbax checkpoints of the whole run: train state, data-iterator state and metadata.

Layout: `workdir/checkpoints/<step>/{state, data, meta}`. orbax writes each step into a
temporary directory and renames it when complete (atomic); `keep` bounds how many stay.

There is one reader, `Checkpointer.restore_latest`, for training and evaluation alike. It walks
back from the newest step: it reads the step's meta, refuses (ConfigError) a checkpoint of
another model config or train-state layout, restores onto the given abstract target and
verifies the fingerprint (per-leaf sums recorded at save time). A step that fails to load or
to match its fingerprint is reported with the reason and the previous one is tried: a
training run moves it to `workdir/checkpoints_corrupt/` (never deleted or overwritten); a
read-only reader (an eval of a possibly live run) leaves it in place.
`meta` and `workdir/model_config.json` (train/workdir_config.py) hold the architecture
(`ModelConfig`); every field must match. Runtime settings (`ComputeConfig`) are not part of it, so a run may resume with others.
Sharded states are saved collectively (every process calls `save`; orbax writes each shard
once) and restored onto whatever shardings the abstract target carries, so a run may resume
on a different mesh (`parallel.runtime.Runtime.restore_target`).
A params export (parameters and routing biases only) is `params_export`'s.

Cloud storage: the checkpoints may live in a bucket (`directory="gs://bucket/run/ckpt"`,
train.checkpoint_dir) while the workdir (logs, lock, metrics) stays local; the workdir then
records the location in `checkpoints.url`, so every later reader (a resume, an eval) finds
them from the workdir alone. Paths go through etils epath (data/storage.py); orbax writes a
gs:// step in place and marks it complete with commit_success.txt (no rename on GCS), so a
step without that file is a partial save and is set aside like a local tmp directory.
Storage failures (no such bucket, no credentials, unreachable) are one line each.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from typing import Any, Callable, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.data import storage
from hybridmoe_jax.parallel.distributed import gather_host_states, own_host_state
from hybridmoe_jax.cli import io_noise
from hybridmoe_jax.train.workdir_config import check_workdir_config, jsonify, legacy_model_dict

LOCATION_FILE = "checkpoints.url"   # in the workdir: where its checkpoints live (gs://...)
_COMMIT_MARKER = "commit_success.txt"  # orbax's "this step is complete" file on GCS


@jax.jit
def _leaf_sums(tree) -> jax.Array:
  """float32 [leaves, 2]: each numeric leaf's sum and sum of magnitudes."""
  leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.number)]
  if not leaves:
    return jnp.zeros((0, 2), jnp.float32)
  return jnp.stack([jnp.stack([jnp.sum(x), jnp.sum(jnp.abs(x))]) for x in leaves])


def fingerprints(tree) -> tuple[list[float], list[float]]:
  """(per-leaf sums, per-leaf sums of |x|), float32: cheap evidence that restored arrays
  are what was saved; the second scales the tolerance (`_same_fingerprint`)."""
  both = np.asarray(_leaf_sums(tree))
  return [float(v) for v in both[:, 0]], [float(v) for v in both[:, 1]]


def fingerprint(tree) -> list[float]:
  """Per-leaf sums (float32): what a checkpoint's meta["fingerprint"] holds."""
  return fingerprints(tree)[0]


def _same_fingerprint(a, b, scale=None) -> bool:
  """Sums `a` (saved) and `b` (restored) agree. With the saved sums of |x| (`scale`), each
  within 1e-5 of its leaf's magnitude: a state saved from many devices or processes and
  restored on one sums in another order, and a leaf whose values cancel (sum 0.326, |x| sum
  in the tens) moves by more than 1e-5 of its sum (seen: 3e-5 after 2 processes x 4 devices).
  Older checkpoints without `scale`: 1e-5 of the sum."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    return False
  if scale is None or np.shape(scale) != a.shape:
    return np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
  return bool(np.all(np.abs(a - b) <= 1e-5 * np.asarray(scale, np.float64) + 1e-6))


def structure_signature(abstract_state) -> str:
  """Tree structure plus leaf shapes/dtypes: equal iff a checkpoint can be restored into it.

  Shardings are not part of it: a state saved on one mesh restores onto another.
  """
  leaves = [f"{tuple(x.shape)}:{x.dtype}" for x in jax.tree.leaves(abstract_state)]
  text = f"{jax.tree.structure(abstract_state)}|{','.join(leaves)}"
  return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------------------- checkpoints
class NonFiniteState(ValueError):
  """A save of a state holding NaN or Inf was refused."""


class CheckpointWriteError(RuntimeError):
  """A checkpoint could not be written (disk full, quota, I/O error): the run stops; the
  checkpoints before it are intact and the unfinished one is set aside on the next start."""


class CorruptStep(ValueError):
  """Files that belong to a checkpoint step (outside orbax's directory) are unreadable."""


class Restored(NamedTuple):
  """What `Checkpointer.restore_latest` returns."""

  state: Any                    # the train state, on the target's shardings
  data_state: dict[str, Any]    # this process's data-iterator state (read-only: as saved)
  meta: dict[str, Any]          # step, model_config (migrated), signature, config, ...


_PRUNED = object()           # Checkpointer._restore_newest: a step vanished while read
_RESTARTS_AFTER_PRUNE = 3


def describe_damage(e: BaseException, part: str) -> str:
  """Why a step could not be read, in one line a user can act on.

  Orbax wraps tensorstore's error in an Exception whose text is the repr of a bound pybind
  method (`<bound method pybind11_detail_function_record_... .spec of TensorStore(...)>`):
  the cause chain holds the real status (OUT_OF_RANGE: a file shorter than its index says,
  DATA_LOSS: bytes that do not decode, NOT_FOUND: a missing file), named here with the
  file and the array it held.

  Args:
    e: the exception restore or read_meta raised.
    part: what was being read ("state", "meta/metadata"), named when nothing better is known.
  """
  chain = io_noise.cause_chain(e)
  texts = [" ".join(str(x).split()) for x in chain]
  for x, text in zip(chain, texts):
    if isinstance(x, json.JSONDecodeError):
      return f"truncated or damaged {part} (not valid JSON: {x.msg} at char {x.pos})"
    files = re.findall(r'local file "([^"]+)"', text)
    array = re.search(r'Error reading "([^"]+)"', text)
    where = files[-1] if files else part
    where = f"a data file of {where}" if where.endswith("/") else where
    where += f" (array {array.group(1)})" if array else ""
    if "OUT_OF_RANGE" in text or "byte range" in text.lower():
      return f"truncated: {where} is shorter than the checkpoint's index says"
    if "DATA_LOSS" in text or "Error decoding" in text or "checksum" in text.lower():
      return f"damaged: {where} does not decode"
    if isinstance(x, FileNotFoundError) and x.filename:
      return f"incomplete: {x.filename} is missing"
    if "NOT_FOUND" in text:
      return f"incomplete: {where} is missing"
  plain = [x for x, t in zip(chain, texts) if "pybind11" not in t]
  return io_noise.one_line(plain[-1] if plain else chain[0])


class Checkpointer:
  """Saves and restores (state, data-iterator state, meta) under workdir/checkpoints.

  `read_only=True` (evals): never creates, saves, moves or deletes anything, so it may read
  a run that is still training; a bad checkpoint is skipped and left in place.
  """

  def __init__(self, workdir: str, *, keep: int | None = None, async_save: bool = True,
               read_only: bool = False, directory: str | None = None):
    self.workdir = os.path.abspath(workdir)  # orbax wants absolute paths
    self.directory = _checkpoint_location(self.workdir, directory, read_only)
    self.remote = storage.is_remote(self.directory)
    self.corrupt_dir = (self.directory.rstrip("/") + "_corrupt" if self.remote
                        else os.path.join(self.workdir, "checkpoints_corrupt"))
    self.read_only = read_only
    self.skipped: list[tuple[int, str]] = []   # (step, why) of the last restore_latest
    self._pending: int | None = None   # the step of the last save started
    self._failed = False               # a write failed (reported as CheckpointWriteError)
    self.before_save: list[Callable[[int], None]] = []   # called with the step to be saved
    io_noise.install()  # also after a failed write, until the process exits
    if read_only:
      if not storage.as_path(self.directory).is_dir():
        raise ValueError(f"{workdir} has no checkpoints/ directory" if not self.remote else
                         f"{self.directory} (the checkpoints of {workdir}) does not exist")
      options = ocp.CheckpointManagerOptions(read_only=True)
    else:
      self._check_writable()
      self._quarantine_partial()
      options = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                             enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def _check_writable(self) -> None:
    """Create checkpoints/ and a probe directory in it: a read-only or foreign-owned
    directory stops the run here, in one line, not at the first save (where orbax's save
    threads would wait for a step directory that never appears)."""
    probe = os.path.join(self.directory, f".write-probe-{os.getpid()}")
    if self.remote:
      try:
        storage.as_path(self.directory).mkdir(parents=True, exist_ok=True)
        storage.as_path(probe).write_text("probe")
        storage.as_path(probe).unlink()
      except Exception as e:  # pylint: disable=broad-except  # cloud clients raise many kinds
        raise CheckpointWriteError(
            f"cannot write checkpoints: {storage.storage_error(self.directory, e, 'write')}; "
            "nothing was trained or changed") from None
      return
    try:
      os.makedirs(self.directory, exist_ok=True)
      os.mkdir(probe)
      os.rmdir(probe)
    except OSError as e:
      what, fix = io_noise.describe_write_error(e)
      raise CheckpointWriteError(
          f"cannot write checkpoints to {self.directory}: {what} ({e.filename or probe}); "
          f"nothing was trained or changed. {fix[0].upper() + fix[1:]}, then rerun") from None

  # ----------------------------------------------------------------------------- save
  def save(self, step: int, state, data_state: dict[str, Any] | None,
           meta: dict[str, Any]) -> bool:
    """Start saving `step` (async); returns False if that step already exists."""
    if self.read_only:
      raise RuntimeError(f"Checkpointer({self.workdir}) is read-only: it cannot save")
    if step in self.manager.all_steps():
      logging.error("checkpoint step %d already exists in %s: not overwritten (was it written "
                    "by another run on this workdir?)", step, self.directory)
      return False
    if jax.default_backend() == "cpu":
      # On CPU orbax's "host copy" may alias the device buffers, which the next (donating)
      # train step reuses while the background write still reads them: save a copy.
      state = jax.tree.map(jnp.copy, state)
    sums, scale = fingerprints(state)
    if not all(np.isfinite(sums)):
      raise NonFiniteState(f"refusing to checkpoint step {step}: the state holds non-finite "
                           "values (a checkpoint must never be worse than the one before it)")
    meta = {**meta, "step": step, "fingerprint": sums, "fingerprint_scale": scale,
            "time": time.time()}
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=ocp.args.JsonSave(gather_host_states(data_state or {})),
                              meta=ocp.args.JsonSave(jsonify(meta)))
    for f in self.before_save:   # a gs:// workdir pushes its logs (train/remote_workdir.py)
      f(step)
    with self._write_errors():  # the previous (async) save's error surfaces here
      self.manager.save(step, args=args, force=True)
    self._pending = step
    return True

  @contextlib.contextmanager
  def _write_errors(self):
    """A failed write (ENOSPC, EDQUOT, EIO...: also one raised in orbax's background thread
    and re-raised at the next save or wait) -> one CheckpointWriteError line."""
    try:
      yield
    except CheckpointWriteError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      err = io_noise.os_error(e)
      if err is None:
        raise
      self._failed = True
      io_noise.release_stuck_writers()  # else Python waits 300 s for them at exit
      what, fix = io_noise.describe_write_error(err)
      good = [s for s in self.manager.all_steps() if s != self._pending]
      raise CheckpointWriteError(
          f"cannot write checkpoint step {self._pending} to {self.directory}: {what} "
          f"({err.filename or self.workdir}); the checkpoints before it are intact (newest: "
          f"{f'step {max(good)}' if good else 'none'}). {fix[0].upper() + fix[1:]} "
          f"({self.workdir}), then rerun to resume") from None

  def wait(self) -> None:
    with self._write_errors():
      self.manager.wait_until_finished()

  def close(self) -> None:
    """Wait for the last save and release orbax's threads (after a failed write: quietly,
    the error has been raised already)."""
    try:
      if not self._failed:
        self.wait()
    finally:
      try:
        self.manager.close()
      except Exception:  # pylint: disable=broad-except
        if not self._failed:
          raise

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  # ----------------------------------------------------------------------------- restore
  def read_meta(self, step: int) -> dict[str, Any]:
    """Step `step`'s meta, its model config migrated to today's layout."""
    meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    return {**meta, "model_config": legacy_model_dict(meta.get("model_config", {}))}

  def restore_latest(self, target: Any | Callable[[dict[str, Any]], Any],
                     model_dict: dict[str, Any],
                     check: Callable[[int, Restored], None] | None = None
                     ) -> Restored | None:
    """The newest good checkpoint, or None if there is none (every skip is in `self.skipped`).

    Args:
      target: the abstract train state to restore onto (jax.ShapeDtypeStruct leaves, with
        shardings on a mesh), or a function meta -> that state for a reader that learns the
        layout from the checkpoint itself (an eval: the optimizer is in meta["config"]).
      model_dict: the model config (dataclasses.asdict(ModelConfig)) the checkpoint must hold.
      check: called as check(step, restored) on a step that restored well; a CorruptStep it
        raises (the step's companion files are unreadable: the RL run's rl_state/<step>.pkl)
        sets the step aside like a damaged one and the previous step is tried.

    Raises:
      ConfigError: the newest readable checkpoint comes from another model config or state
        layout (e.g. a different optimizer): nothing is restored or moved then.
    """
    target_for = target if callable(target) else lambda _: target
    self.skipped = []
    # A writer may rotate a step away (keep_checkpoints) while a reader beside it reads that
    # step: then the reader starts again from the newest step that exists now, instead of
    # calling a pruned step corrupt. Bounded: a writer cannot prune faster than it saves.
    for _ in range(_RESTARTS_AFTER_PRUNE + 1):
      restored = self._restore_newest(target_for, model_dict, check)
      if restored is not _PRUNED:
        return restored
      self.manager.reload()
    raise ValueError(f"checkpoints in {self.directory} were removed while being read "
                     f"{_RESTARTS_AFTER_PRUNE + 1} times in a row (a run beside this one "
                     "keeps rotating them out); retry, or read a copy of the directory")

  def _restore_newest(self, target_for, model_dict, check) -> Restored | None | object:
    """One pass of restore_latest, newest step first -> Restored, None, or _PRUNED (a step
    vanished from disk while it was being read: the caller starts again)."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        meta = self.read_meta(step)
      except Exception as e:  # pylint: disable=broad-except
        if self._pruned(step):
          return _PRUNED
        self._skip(step, f"unreadable metadata: {describe_damage(e, 'meta/metadata')}")
        continue
      check_workdir_config(self.workdir, model_dict, saved=meta["model_config"],
                           source=f"checkpoint step {step}")
      abstract = target_for(meta)
      if meta.get("signature") not in (None, structure_signature(abstract)):
        raise ConfigError(
            f"checkpoint step {step} in {self.directory} has a different train-state layout "
            "(model, optimizer, clipping or layer stacking changed: train.optimizer / "
            "train.clip / compute.scan_layers). Use a fresh --workdir or the original config "
            "(a state converts between compute.scan_layers layouts with "
            "hybridmoe_jax.model.stack.stack_state / unstack_state).")
      io_noise.install()  # pytest, for one, resets the hook between tests
      try:
        r = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        if self._pruned(step):
          return _PRUNED
        self._skip(step, describe_damage(e, "state"))
        continue
      if not _same_fingerprint(meta.get("fingerprint", []), fingerprint(r.state),
                               meta.get("fingerprint_scale")):
        if self._pruned(step):
          return _PRUNED
        self._skip(step, "restored values do not match the fingerprint saved with them")
        continue
      # A read-only reader resumes no data iterator: the record stays as saved (it may hold
      # every process's state of a multi-process run).
      data = r.data if self.read_only else own_host_state(r.data)
      restored = Restored(r.state, data, meta)
      if check is not None:
        try:
          check(step, restored)
        except CorruptStep as e:
          self._skip(step, str(e))
          continue
      logging.info("restored checkpoint step %d from %s", step, self.directory)
      return restored
    return None

  def _pruned(self, step: int) -> bool:
    """Step `step` is gone from disk now (rotated out by a writer beside this reader)."""
    if storage.as_path(os.path.join(self.directory, str(step))).is_dir():
      return False
    logging.warning("checkpoint step %d was removed while this run read it (a run beside it "
                    "rotates checkpoints out: keep_checkpoints); reading the newest step that "
                    "exists now", step)
    return True

  def _skip(self, step: int, why: str) -> None:
    """Report a bad checkpoint; a writer moves it aside so that no later run tries it."""
    self.skipped.append((step, why))
    if self.read_only:
      logging.warning("checkpoint step %d is corrupt or partial (%s); left in place "
                      "(read-only), trying the previous one", step, why)
      return
    dst = self._set_aside(str(step))
    logging.warning("checkpoint step %d is corrupt or partial (%s); moved to %s, trying the "
                    "previous one", step, why, dst)
    self.manager.reload()

  def _set_aside(self, name: str) -> str:
    """Move directory `name` into corrupt_dir as `<name>-<ms>` (never overwritten) -> there."""
    dst = os.path.join(self.corrupt_dir, f"{name}-{int(time.time() * 1000)}")
    if self.remote:  # GCS has no directory rename: copy every object, then delete
      src = os.path.join(self.directory, name)
      fs, _ = storage.fsspec_for(src)
      fs.copy(src, dst, recursive=True)
      fs.rm(src, recursive=True)
      fs.invalidate_cache()  # listings cached before the move would still show it
      return dst
    os.makedirs(self.corrupt_dir, exist_ok=True)
    shutil.move(os.path.join(self.directory, name), dst)
    return dst

  def _quarantine_partial(self) -> None:
    """Move aside unfinished temporary step directories left by a killed save."""
    for name in sorted(_listdir(self.directory)):
      # On GCS orbax writes a step in place: one without its commit marker is partial.
      partial = ".orbax-checkpoint-tmp" in name or (
          self.remote and name.isdigit()
          and not storage.as_path(os.path.join(self.directory, name, _COMMIT_MARKER)).exists())
      if partial:
        logging.warning("found a partial checkpoint %s (a save was interrupted); moved to %s",
                        name, self._set_aside(name))


# ------------------------------------------------------------------------------ locations
def _listdir(path: str) -> list[str]:
  if storage.is_remote(path):  # a bucket has no empty directories: nothing there yet
    try:
      return [p.name for p in storage.as_path(path).iterdir()]
    except FileNotFoundError:
      return []
  return os.listdir(path)


def _checkpoint_location(workdir: str, directory: str | None, read_only: bool) -> str:
  """workdir/checkpoints, or the remote `directory` (recorded in workdir/checkpoints.url;
  a later reader without `directory` finds it there). ConfigError (one line) when the
  workdir records another location than the one asked for."""
  record = os.path.join(workdir, LOCATION_FILE)
  saved = None
  if os.path.isfile(record):
    with open(record, encoding="utf-8") as f:
      saved = f.read().strip() or None
  given = directory
  if directory and not storage.is_remote(directory):
    directory = os.path.abspath(directory)   # as recorded: a relative path matches its record
  if directory and saved and directory.rstrip("/") != saved.rstrip("/"):
    raise ConfigError(f"train.checkpoint_dir = {given!r}, but the checkpoints of {workdir} "
                      f"are in {saved!r} ({record}); use that, or a fresh --workdir")
  directory = directory or saved
  if not directory:
    return os.path.join(workdir, "checkpoints")
  if not storage.is_remote(directory):
    directory = os.path.abspath(directory)
  if not saved and not read_only:
    os.makedirs(workdir, exist_ok=True)
    with open(record + ".tmp", "w", encoding="utf-8") as f:
      f.write(directory + "\n")
    os.replace(record + ".tmp", record)
  return directory
