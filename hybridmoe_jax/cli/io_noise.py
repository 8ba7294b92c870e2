"""Checkpoint I/O noise that a user cannot act on, made quiet or one line.

orbax logs dozens of INFO lines per save, read-only notices on every eval's restore and, when
a background write fails (disk full), a traceback through tensorstore; a failed restore
leaves concurrent reads behind whose reports flood the log. `install()` (idempotent, called
by every `Checkpointer` and before each restore) filters exactly those records; the errors
themselves reach the user once, as one line (`one_line`, `os_error`).
"""

from __future__ import annotations

import errno
import logging as std_logging
import os
import sys
import threading
import warnings

from absl import logging


def one_line(e: BaseException, limit: int = 240) -> str:
  """An exception as one short line (tensorstore errors span dozens of lines)."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:limit]}{' ...' if len(text) > limit else ''}"


# The OS errors that mean "this file system cannot take the write": disk full, quota, a file
# bigger than the file-size limit (RLIMIT_FSIZE / the file system's), read-only, permission.
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def describe_write_error(err: OSError) -> tuple[str, str]:
  """(what happened, what to do) for a failed write, in words a user can act on."""
  what = {errno.ENOSPC: "no space left on device",
          errno.EDQUOT: "disk quota exceeded",
          errno.EFBIG: "file too large for the file-size limit (ulimit -f) or file system",
          errno.EROFS: "read-only file system",
          errno.EACCES: "permission denied",
          errno.EPERM: "operation not permitted"}.get(err.errno, err.strerror or one_line(err))
  fix = {errno.ENOSPC: "free space", errno.EDQUOT: "free space or raise the quota",
         errno.EFBIG: "raise the file-size limit (ulimit -f) or use another file system"
         }.get(err.errno, "fix the permissions or use a writable directory")
  return what, fix


def cause_chain(e: BaseException | None) -> list[BaseException]:
  """`e` and the exceptions behind it (__cause__, else __context__), outermost first, once."""
  chain, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    chain.append(e)
    e = e.__cause__ or e.__context__
  return chain


def os_error(e: BaseException) -> OSError | None:
  """The OSError behind `e` (orbax re-raises background-thread errors wrapped; tensorstore
  raises ValueErrors that only name the OS error), if any."""
  for x in cause_chain(e):
    if isinstance(x, OSError) and x.errno is not None:
      return x
    for code in _WRITE_ERRNOS:  # tensorstore names the OS error only in a message
      if os.strerror(code) in str(x):
        return OSError(code, os.strerror(code))
  return None


# Warnings orbax prints for every read-only CheckpointManager (each eval): they restate the
# read_only=True we asked for, so a user has nothing to act on.
_READ_ONLY_NOISE = ("CheckpointManagerOptions.read_only=True, setting ",
                    "Given directory is read only=")


class _QuietOrbax(std_logging.Filter):
  """Drop orbax's INFO chatter (dozens of lines per save) and its read-only notices; keep
  its other warnings and errors.

  A failed background write (disk full) is logged by orbax's save thread with a traceback,
  and again by each layer that re-raises it (three ERROR records for one failure);
  `Checkpointer` reports it as the run's one CheckpointWriteError line, so the first record
  becomes one warning line and its repeats are dropped.
  """

  def __init__(self):
    super().__init__()
    self._failures: set[str] = set()

  def filter(self, record) -> bool:
    if "orbax" not in record.pathname:
      return True
    if record.exc_info and os_error(record.exc_info[1]) is not None:
      text = one_line(record.exc_info[1])
      if text in self._failures:
        return False
      self._failures.add(text)
      record.msg, record.args = "a checkpoint write failed: %s", (text,)
      record.exc_info = record.exc_text = None
      record.levelno, record.levelname = std_logging.WARNING, "WARNING"
      return True
    if record.levelno >= 30:
      return not str(record.msg).startswith(_READ_ONLY_NOISE)
    return False


def _quiet_orbax_logs() -> None:
  absl_logger = logging.get_absl_logger()
  if not any(isinstance(f, _QuietOrbax) for f in absl_logger.filters):
    absl_logger.addFilter(_QuietOrbax())


class _AbandonedReads(std_logging.Filter):
  """Drops asyncio's "exception was never retrieved" reports (one multi-line ERROR per array)."""

  def filter(self, record) -> bool:
    return "exception was never retrieved" not in str(record.msg)


def _drop_abandoned_read_reports() -> None:
  """Silence the reports of reads (or writes) a failed restore (or save) abandoned
  (idempotent: called by every Checkpointer and before each restore).

  orbax reads a step's arrays concurrently on an event loop of its own; when one read fails
  it raises that error (reported by the caller, one line) and closes the loop while the
  other reads are still in flight (a save that hits a full disk does the same with
  writes). Each of those later reports the same failure: asyncio logs
  "Future exception was never retrieved" with the whole tensorstore spec when its future is
  garbage-collected; tensorstore's completion callback, finding the loop closed, raises
  "Event loop is closed" where nothing can catch it (sys.unraisablehook); an unfinished read
  coroutine, when collected, raises from its GeneratorExit (unraisable too). Their results
  are discarded anyway, so exactly these three reports are dropped; anything else passes.
  """
  log = std_logging.getLogger("asyncio")
  if not any(isinstance(f, _AbandonedReads) for f in log.filters):
    log.addFilter(_AbandonedReads())
  if getattr(sys.unraisablehook, "drops_closed_loop", False):
    return
  previous = sys.unraisablehook

  def hook(u):
    closed_loop = (isinstance(u.exc_value, RuntimeError)
                   and str(u.exc_value) == "Event loop is closed")
    # An unfinished orbax read or write coroutine, finalised by the garbage collector or at
    # interpreter exit, raises from its cleanup (orbax's read turns the GeneratorExit into
    # "Encountered error while reading array index ..."; a write's byte-limit release fails
    # once Python is shutting down).
    abandoned_io = any(name in repr(u.object)
                       for name in ("_read_array_index_and_device_put", "write_fragment"))
    if not (closed_loop or abandoned_io):
      previous(u)

  hook.drops_closed_loop = True
  sys.unraisablehook = hook


def release_stuck_writers() -> int:
  """Cancel orbax's background save threads that wait for a step directory that will never
  exist (its creation failed: read-only or permission denied). Each waits on a signal for
  the coordination timeout (300 s) and is not a daemon, so Python would wait for them at
  exit; setting the signal they wait for lets each see its cancel flag and return.
  Returns how many were released. Their never-started write coroutines are then collected
  unawaited, which Python reports at exit: those reports are dropped too."""
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited",
                          category=RuntimeWarning)
  try:
    from orbax.checkpoint._src.futures import future  # pylint: disable=g-import-not-at-top
  except ImportError:  # another orbax layout: nothing known to release
    return 0
  released = 0
  for t in threading.enumerate():
    if isinstance(t, future._SignalingThread) and t.is_alive():  # pylint: disable=protected-access
      t.cancel()
      try:
        future.set_signals(t._receive_signals, operation_id=t._operation_id)  # pylint: disable=protected-access
      except Exception:  # pylint: disable=broad-except
        continue
      released += 1
  return released


def install() -> None:
  """Both filters; safe to call any number of times."""
  _quiet_orbax_logs()
  _drop_abandoned_read_reports()
