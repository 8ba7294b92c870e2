"""One training run per workdir: a lock file holding the owner's host, PID and a heartbeat.

`workdir/run.lock` is created with O_CREAT | O_EXCL (atomic on local and network file
systems), so of two runs started on one workdir exactly one gets it; the other stops with one
line naming the holder. A lock left behind by a run that died is stale and is taken over
(with a warning) when
  - its host is this host and its PID is no longer alive (or is a different process: the
    recorded process start time differs); on the same host the PID alone decides, or
  - it comes from another host and its heartbeat (the file's mtime, touched every
    `heartbeat_s` by a daemon thread of the holder) is older than `stale_after_s`: the only
    evidence available for another host.
Taking over renames the stale file aside (its record is kept), then creates a fresh lock; the
judge-and-replace step runs under flock on `run.lock.guard`, so two runs racing for one stale
lock cannot both win.
The file operations are the methods `_guard`, `_try_create`, `_read_holder`, `_age`,
`_move_aside`, `_touch` and `_remove_own`: a lock kept elsewhere (a gs:// workdir's object,
`train/remote_workdir.py`) overrides them and keeps these rules.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time

from absl import logging

LOCK_FILE = "run.lock"
_HELD: set[str] = set()   # lock files this process holds (for `drop_held_locks`)


class WorkdirBusy(RuntimeError):
  """Another live run holds the workdir."""


def _proc_start_time(pid: int) -> str | None:
  """The kernel's start time of `pid` (field 22 of /proc/<pid>/stat), None if unknown."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      stat = f.read()
  except OSError:
    return None
  return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name start at 3


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, owned by another user
    return True
  return True


class WorkdirLock:
  """Hold `workdir/run.lock` for the lifetime of a run (a context manager).

  Raises WorkdirBusy on entry if a live run holds it.
  """

  def __init__(self, workdir: str, *, stale_after_s: float = 600.0, heartbeat_s: float = 30.0):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.stale_after_s = stale_after_s
    self.heartbeat_s = heartbeat_s
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._held = False

  # ----------------------------------------------------------------------------- acquire
  def _record(self) -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "proc_start": _proc_start_time(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

  def _try_create(self) -> bool:
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(self._record(), f)
    return True

  def _read_holder(self) -> dict | None:
    """The holder's record; {} if unreadable (a holder that died while writing it)."""
    try:
      with open(self.path, encoding="utf-8") as f:
        return json.load(f)
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      return {}

  def _why_stale(self, holder: dict) -> str | None:
    """Why the holder's lock is stale, or None if it may still be alive."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
      # Same host: the PID decides (a stopped or busy run with an old heartbeat is alive).
      pid = holder["pid"]
      if not _pid_alive(pid):
        return f"process {pid} is not running"
      start = _proc_start_time(pid)
      if holder.get("proc_start") and start and start != holder["proc_start"]:
        return f"PID {pid} now belongs to another process"
      return None
    age = self._age()
    if age is None:
      return "it vanished"
    if age > self.stale_after_s:
      return f"no heartbeat for {age:.0f} s (> {self.stale_after_s:.0f} s)"
    if not holder and age > 2 * self.heartbeat_s:
      return "its record is unreadable and it has no recent heartbeat"
    return None

  def _age(self) -> float | None:
    """Seconds since the holder's last heartbeat (the file's mtime); None if it is gone."""
    try:
      return time.time() - os.stat(self.path).st_mtime
    except FileNotFoundError:
      return None

  @contextlib.contextmanager
  def _guard(self):
    # Judging a lock stale and replacing it must be one step: else a run could judge the old
    # record, another replace it meanwhile, and the first move the fresh lock aside. flock on
    # a guard file serialises that step between processes of one host (on file systems
    # without flock the O_EXCL create still keeps two fresh starts apart).
    guard = os.open(self.path + ".guard", os.O_CREAT | os.O_RDWR, 0o644)
    try:
      try:
        fcntl.flock(guard, fcntl.LOCK_EX)
      except OSError:
        pass
      yield
    finally:
      os.close(guard)  # releases the flock

  def _move_aside(self, aside: str) -> bool:
    """Move the (stale) lock to `aside`; False if it is gone (another run moved it)."""
    try:
      os.rename(self.path, aside)  # one of several racing runs wins this rename
    except FileNotFoundError:
      return False
    return True

  def _touch(self) -> None:
    os.utime(self.path)

  def _remove_own(self) -> None:
    """Remove the lock if this process still holds it."""
    holder = self._read_holder() or {}
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass

  def acquire(self) -> None:
    with self._guard():
      self._acquire()
    self._held = True
    _HELD.add(self.path)
    self._thread = threading.Thread(target=self._heartbeat, name="workdir-lock-heartbeat",
                                    daemon=True)
    self._thread.start()

  def _acquire(self) -> None:
    for _ in range(5):
      if self._try_create():
        break
      holder = self._read_holder()
      if holder is None:  # released between our two calls: try again
        continue
      why = self._why_stale(holder)
      if why is None:
        raise WorkdirBusy(
            f"workdir {os.path.dirname(self.path)} is in use by another run (pid "
            f"{holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
            f"{holder.get('started', '?')}; lock file {self.path}). Wait for it, stop it, or "
            "use another --workdir")
      aside = f"{self.path}.stale-{os.getpid()}-{int(time.time() * 1000)}"
      if not self._move_aside(aside):
        continue
      logging.warning("took over the stale lock of a run that is gone (pid %s on host %s: "
                      "%s); its record is kept as %s", holder.get("pid", "?"),
                      holder.get("host", "?"), why, aside)
    else:
      raise WorkdirBusy(f"could not take the lock {self.path}: other runs keep taking it")

  def _heartbeat(self) -> None:
    while not self._stop.wait(self.heartbeat_s):
      try:
        self._touch()
      except OSError as e:  # lock removed by hand or file system gone: say so once
        logging.warning("cannot refresh the workdir lock %s (%s)", self.path, e)
        return

  # ----------------------------------------------------------------------------- release
  def release(self) -> None:
    if not self._held:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    self._held = False
    _HELD.discard(self.path)
    self._remove_own()

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def drop_held_locks() -> None:
  """Remove the lock files this process holds, without waiting for anything: for a process
  about to `os._exit` (a second SIGINT). Safe in a signal handler: no locks taken."""
  for path in list(_HELD):
    try:
      os.remove(path)
    except OSError:
      pass
