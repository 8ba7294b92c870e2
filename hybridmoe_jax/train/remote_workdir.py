"""A gs:// `--workdir` (what MaxText calls base_output_directory=gs://...).

Design: orbax writes the checkpoints straight into the bucket (`<url>/checkpoints`, or
train.checkpoint_dir). The workdir's small files (model_config.json, inputs.json,
metrics.jsonl, TensorBoard events, heatmaps, checkpoints.url, tokenizer/) are written to a
local staging directory (under the cache, keyed by the URL and the process), because they
are appended to and an object cannot be: the staging directory is rebuilt from the bucket
when a run starts (`storage.mirror`: a fresh machine resumes from gs:// alone, and lines a
killed run never pushed go with it), and the files that changed are pushed back as whole
objects before each checkpoint save starts (a committed step's logs are in the bucket) and
when the run ends.

The run lock is an object, `<url>/run.lock`, with the local lock's rules and record
(`cli/workdir_lock.py`): it is created only if absent (GCS precondition ifGenerationMatch=0),
so of two runs exactly one gets it; the holder's heartbeat is a metadata update every
`heartbeat_s`; a stale lock (same host and the PID gone, or another host and no heartbeat for
`stale_after_s`) is deleted only at the generation that was judged (a racing run that took it
over first makes that delete fail) and its record kept as `run.lock.stale-<pid>-<ms>`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import pathlib
import shutil
import time

from absl import logging
import jax

from hybridmoe_jax.cli import workdir_lock
from hybridmoe_jax.cli.errors import InputError
from hybridmoe_jax.data import storage

# Not mirrored into staging (fnmatch patterns of the first path part): orbax's directories,
# and the lock with its stale records.
NOT_STAGED = ("checkpoints", "checkpoints_corrupt", workdir_lock.LOCK_FILE,
              f"{workdir_lock.LOCK_FILE}.stale-*")
_MANIFEST = ".mirror.json"


class BucketLock(workdir_lock.WorkdirLock):
  """`<url>/run.lock` as a GCS object (module docstring); a context manager like WorkdirLock."""

  def __init__(self, url: str, **kw):
    super().__init__(url, **kw)
    self._fs, key = storage.fsspec_for(self.path)
    self._bucket, _, self._key = key.partition("/")
    self._gen: str | None = None    # the generation of the lock this process holds
    self._seen: dict | None = None  # the holder's object metadata, as last read
    self._body = b""                # and its record

  def _object(self, method: str, **kw):
    return self._fs.call(method, "b/{}/o/{}", self._bucket, self._key, **kw)

  def _guard(self):
    return contextlib.nullcontext()   # every replacing step is conditional on a generation

  def _try_create(self) -> bool:
    location = self._fs._location  # pylint: disable=protected-access  # the API endpoint
    upload = f"{location}/upload/storage/v1/b/{self._bucket}/o"
    try:
      made = self._fs.call("POST", upload, uploadType="media", name=self._key,
                           ifGenerationMatch="0", data=json.dumps(self._record()).encode(),
                           json_out=True)
    except FileExistsError:   # 412: the object exists
      return False
    self._gen = str(made["generation"])
    return True

  def _read_holder(self) -> dict | None:
    try:   # metadata first: a record read after it is of that generation or a newer one
      self._seen = self._object("GET", json_out=True)
      _, self._body = self._object("GET", alt="media", generation=self._seen["generation"])
    except FileNotFoundError:
      return None
    try:
      return json.loads(self._body)
    except ValueError:
      return {}

  def _age(self) -> float | None:
    if not self._seen:
      return None
    beat = (self._seen.get("metadata") or {}).get("heartbeat")
    if beat:
      return time.time() - float(beat)
    updated = self._seen["updated"].replace("Z", "+00:00")
    return time.time() - datetime.datetime.fromisoformat(updated).timestamp()

  def _move_aside(self, aside: str) -> bool:
    try:
      self._object("DELETE", ifGenerationMatch=self._seen["generation"])
    except (FileNotFoundError, FileExistsError):  # gone, or replaced since it was judged
      return False
    try:
      self._fs.pipe_file(aside, self._body)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("could not keep the stale lock's record as %s (%s)", aside, e)
    return True

  def _touch(self) -> None:
    try:
      self._object("PATCH", json={"metadata": {"heartbeat": f"{time.time():.3f}"}},
                   ifGenerationMatch=self._gen)
    except (FileNotFoundError, FileExistsError):
      raise OSError("the lock object was removed or taken over") from None
    except Exception as e:  # pylint: disable=broad-except  # a network blip: beat again later
      logging.warning("cannot refresh the workdir lock %s (%s); retrying", self.path, e)

  def _remove_own(self) -> None:
    try:
      self._object("DELETE", ifGenerationMatch=self._gen)
    except (FileNotFoundError, FileExistsError):
      pass
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("could not remove the workdir lock %s (%s): the next run on this host "
                      "takes it over", self.path, e)


def staging_dir(url: str) -> pathlib.Path:
  """The local staging directory of gs:// workdir `url` for this process."""
  key = hashlib.sha256(f"{url.rstrip('/')}|{jax.process_index()}".encode()).hexdigest()[:16]
  return storage.cache_dir() / f"workdir-{key}"


class Staged:
  """A gs:// workdir's local staging directory while a run writes it."""

  def __init__(self, url: str):
    self.url = url.rstrip("/")
    self.local = str(staging_dir(self.url))
    self._pushed: dict[str, tuple[int, int]] = {}

  def _mine(self, rel: str) -> bool:
    """Files this process pushes: process 0 the run's, process i its process_<i>/ logs."""
    i = jax.process_index()
    own = rel.startswith(f"process_{i}/")
    return rel != _MANIFEST and (own if i else not rel.startswith("process_"))

  def _stats(self) -> dict[str, tuple[int, int]]:
    out = {}
    for p in pathlib.Path(self.local).rglob("*"):
      rel = p.relative_to(self.local).as_posix()
      if p.is_file() and self._mine(rel) and ".part" not in p.name:
        st = p.stat()
        out[rel] = (st.st_size, st.st_mtime_ns)
    return out

  def pull(self) -> None:
    """Rebuild staging from the bucket (empty when the workdir is new)."""
    try:
      storage.mirror(self.url, self.local, skip=NOT_STAGED, what="workdir files")
    except FileNotFoundError:   # a new workdir (or one holding only checkpoints)
      shutil.rmtree(self.local, ignore_errors=True)
      os.makedirs(self.local)
    self._pushed = self._stats()

  def push(self, *_) -> None:
    """Upload every file of ours that changed since the last pull or push (whole objects)."""
    for rel, st in sorted(self._stats().items()):
      if self._pushed.get(rel) != st:
        storage.upload(self.local, self.url, [rel])
        self._pushed[rel] = st

  def push_at_checkpoint(self, step: int) -> None:
    """`push` that never stops training: a failure is retried at the next save."""
    try:
      self.push()
    except OSError as e:
      logging.warning("step %d: the workdir files were not pushed to the bucket (%s); they "
                      "are kept in %s and pushed at the next checkpoint", step, e, self.local)

  def close(self) -> None:
    """The final push; one line naming the staging directory if it fails."""
    try:
      self.push()
    except OSError as e:
      raise InputError(f"{e}; the run's logs and metrics are kept in {self.local}: copy them "
                       f"to {self.url} (the checkpoints are in the bucket)") from None


def open_staged(url: str, closing: contextlib.ExitStack, *, stale_after_s: float) -> Staged:
  """The run lock (process 0; another live run -> InputError), staging rebuilt from the
  bucket, the final push registered on `closing` (it runs before the lock is released)."""
  staged = Staged(url)
  if jax.process_index() == 0:
    try:
      closing.enter_context(BucketLock(staged.url, stale_after_s=stale_after_s))
    except workdir_lock.WorkdirBusy as e:
      raise InputError(str(e)) from None
    except Exception as e:  # pylint: disable=broad-except  # cloud clients raise many kinds
      raise InputError(str(storage.storage_error(url, e, "lock"))) from None
  staged.pull()
  closing.callback(staged.close)
  return staged
