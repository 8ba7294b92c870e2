"""Shared pieces of the sandbox attack suites: the victim directory outside the sandbox, a
snapshot to compare it by, and the kernel-wall suite's preludes (the audit hook switched
off, `attempt`, ctypes under another name) with the runner that reads their results."""

import json
import os
import stat

import pytest

from hybridmoe_jax.rl.sandbox import SandboxLimits, run_python

# Both suites' disk limits: 2 MB files, 8 of them.
DISK_LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=4, memory_mb=256, file_size_mb=2,
                            max_files=8)


def snapshot(root) -> dict:
  """{relative path: (kind, mode, content)} of everything under `root`."""
  out = {}
  for d, dirs, files in os.walk(root):
    for n in dirs + files:
      p = os.path.join(d, n)
      st = os.lstat(p)
      content = open(p, "rb").read() if stat.S_ISREG(st.st_mode) else None
      out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), content)
  return out


@pytest.fixture
def victim(tmp_path):
  """A directory outside the sandbox with a file and a subdirectory to protect."""
  root = tmp_path / "victim"
  (root / "sub").mkdir(parents=True)
  (root / "keep.txt").write_text("precious")
  (root / "sub" / "inner.txt").write_text("also precious")
  return root


# An object whose __eq__ runs inside the hook (the hook compares a rename's dir_fd with
# None) walks up to the hook's frame and swaps the closure cells `deny` calls for no-ops:
# from then on the hook still sees every event and stops none.
HOOK_OFF = """
import sys
class _Key:
  def __eq__(self, other):
    f = sys._getframe(1)
    while f is not None and "deny" not in f.f_locals:
      f = f.f_back
    deny = f.f_locals["deny"]
    cells = dict(zip(deny.__code__.co_freevars, deny.__closure__))
    cells["exit_"].cell_contents = lambda code: None
    cells["write"].cell_contents = lambda fd, data: None
    return False
  __hash__ = object.__hash__
sys.audit("os.rename", "a", "b", _Key(), None)
"""
# `attempt(name, fn, *args)` records "ok" or the errno's name; the last stdout line is them all.
ATTEMPT = """
import errno, json, os
RESULTS = {}
def attempt(name, fn, *args):
  try:
    fn(*args)
    RESULTS[name] = "ok"
  except OSError as e:
    RESULTS[name] = errno.errorcode.get(e.errno, str(e.errno))
  except Exception as e:
    RESULTS[name] = type(e).__name__
"""
# ctypes loaded as "innocent._ctypes": an import guard that checks names sees no ctypes.
CTYPES_RENAMED = """
import glob, importlib.machinery, importlib.util
_path = glob.glob(sys.base_prefix + "/lib/python3*/lib-dynload/_ctypes.*.so")[0]
_spec = importlib.util.spec_from_file_location(
    "innocent._ctypes", _path, loader=importlib.machinery.ExtensionFileLoader("_ctypes", _path))
sys.modules["_ctypes"] = importlib.util.module_from_spec(_spec)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def syscall(nr, *args):
  r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a
                                        for a in args])
  if r < 0:
    raise OSError(ctypes.get_errno(), "")
"""
HOSTILE = SandboxLimits(timeout_s=5.0, cpu_s=3, memory_mb=256)


def hostile(body: str, limits: SandboxLimits = HOSTILE, **fmt):
  """Runs HOOK_OFF + ATTEMPT + `body` (formatted with fmt); (result, attempts dict)."""
  r = run_python(HOOK_OFF + ATTEMPT + body.format(**fmt) + "\nprint(json.dumps(RESULTS))\n",
                 limits)
  lines = r.stdout.strip().splitlines()
  try:
    return r, json.loads(lines[-1])
  except (IndexError, ValueError):
    return r, {"<no report>": (r.killed, r.detail, r.stderr_tail[-600:])}
