"""Run a CLI with an OS-level fault injected: `python tests/faults/inject.py FAULT SCRIPT ARGS...`
(SCRIPT: a path, or `-m module`).

The tests run as root, where a chmod'ed read-only directory does not deny anything, and a
real full disk needs a mount; so the faults are raised where the OS call is made, in the
process under test, before the script starts:

  ro_checkpoints   creating anything in `<workdir>/checkpoints/` -> EACCES (a read-only
                   or foreign-owned checkpoints/ directory)
  ro_steps         creating a step directory there -> EACCES (checkpoints/ made read-only
                   while the run trains)
  enospc:SUBSTR    a write (open for writing, write) to a path containing SUBSTR -> ENOSPC
  efbig:SUBSTR     the same with EFBIG (RLIMIT_FSIZE / file-size limit)
  edquot:SUBSTR    the same with EDQUOT (quota)
  oom              the first train step raises XLA's RESOURCE_EXHAUSTED

The fault is chosen by the first argument only; everything else is the real program.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import runpy
import sys

_ERRNO = {"enospc": errno.ENOSPC, "efbig": errno.EFBIG, "edquot": errno.EDQUOT}


def _raise(code: int, path) -> None:
  raise OSError(code, os.strerror(code), os.fspath(path) if path is not None else None)


def _read_only_checkpoints(steps_only: bool) -> None:
  """EACCES for every directory or file created inside a directory named checkpoints/ (or
  only for orbax's temporary step directories)."""
  real_mkdir, real_open = os.mkdir, os.open

  def blocked(path) -> bool:
    try:
      path = os.path.abspath(os.fsdecode(os.fspath(path)))
    except TypeError:
      return False
    if steps_only and ".orbax-checkpoint-tmp" not in os.path.basename(path):
      return False
    return os.path.basename(os.path.dirname(path)) == "checkpoints"

  def mkdir(path, *a, **k):
    if blocked(path):
      _raise(errno.EACCES, path)
    return real_mkdir(path, *a, **k)

  def os_open(path, flags, *a, **k):
    if flags & os.O_CREAT and blocked(path):
      _raise(errno.EACCES, path)
    return real_open(path, flags, *a, **k)

  os.mkdir, os.open = mkdir, os_open


def _full(code: int, substr: str) -> None:
  """`code` for every open-for-writing of a path containing `substr` (builtins.open, io.open
  and os.open: what Python code, orbax's JSON writer and the safetensors writer use)."""
  real_open, real_os_open = builtins.open, os.open

  def matches(path) -> bool:
    return isinstance(path, (str, bytes, os.PathLike)) and substr in os.fsdecode(os.fspath(path))

  def opener(file, mode="r", *a, **k):
    if matches(file) and any(c in mode for c in "wax+"):
      _raise(code, file)
    return real_open(file, mode, *a, **k)

  def os_open(path, flags, *a, **k):
    if matches(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
      _raise(code, path)
    return real_os_open(path, flags, *a, **k)

  builtins.open = io.open = opener
  os.open = os_open


def _oom_at_first_step() -> None:
  from hybridmoe_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
  real = step_lib.make_train_step

  def make_train_step(*a, **k):
    real(*a, **k)

    def oom(*_a, **_k):
      from jax.errors import JaxRuntimeError  # pylint: disable=import-outside-toplevel
      raise JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                            "17179869184 bytes.")
    return oom

  step_lib.make_train_step = make_train_step


def main() -> None:
  fault, target, *args = sys.argv[1:]
  kind, _, arg = fault.partition(":")
  if kind in ("ro_checkpoints", "ro_steps"):
    _read_only_checkpoints(steps_only=kind == "ro_steps")
  elif kind in _ERRNO:
    _full(_ERRNO[kind], arg)
  elif kind == "oom":
    _oom_at_first_step()
  else:
    raise SystemExit(f"inject.py: unknown fault {fault!r}")
  if target == "-m":
    module, *args = args
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  else:
    sys.argv = [target, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
  main()
