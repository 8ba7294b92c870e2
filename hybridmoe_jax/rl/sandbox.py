"""Run untrusted Python (model-written code) in a limited subprocess.

`run_python(source)` runs a script; `run_calls(source, calls, expected)` defines the
solution's functions, calls each (name, args) and compares the results with `expected` in
THIS process (the expected values never reach the child, so printing cannot fake a pass).
Each run: a fresh temp dir as cwd (deleted afterwards), `python -I -S -B` (no site, no user
paths, only a minimal PATH/LANG), its own process group, and `rl/sandbox_boot.py` first,
which sets the limits and an audit hook.

Guaranteed (kernel-enforced): CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file
size (RLIMIT_FSIZE, also capping stdout/stderr, which go to files), open files, no core
dumps; a wall-clock timeout, then SIGKILL of the whole process group (also after every
normal exit). RLIMIT_NPROC = max_procs (default 0: no fork / threads; root ignores it, so
as root only the audit hook stops process creation). Disk: at most about (max_files + 2) x
file_size_mb in the temp dir (files opened for writing and directories made are counted by
the hook; `SandboxResult.disk_bytes` reports what was left).
Best effort (PEP 578 audit hooks are NOT a security boundary): the hook (sandbox_boot.py
lists what it refuses: processes, sockets, ctypes, any change to a path outside the temp
dir, ...) reads each path as the characters of a fresh exact str (str / bytes subclasses
cannot answer for it), made absolute and resolved by its own symlink walk, so `..`,
/proc/self/root, /proc/self/cwd and /dev/fd/N point where the kernel would go. Code that
corrupts interpreter memory, or a C extension doing its own I/O, escapes it.
Reading is allowed by design (environments need the standard library; secrets must not be
readable by the user running RL). Without OS namespaces (bubblewrap, nsjail, gVisor, a
container with no network and a read-only root) there is no real network or filesystem
isolation: run RL with untrusted or adversarial code only inside one.

Results never raise for what the code does: the caller gets a SandboxResult with `killed`
set ("timeout", "cpu", "memory", "output", "violation", "signal", "error") and continues.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from hybridmoe_jax.config import Checked, ranged

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")
VIOLATION_EXIT = 86          # sandbox_boot.VIOLATION_EXIT (kept equal by a test)
TAIL_CHARS = 2000


@dataclasses.dataclass(frozen=True)
class SandboxLimits(Checked):
  """Per-run limits (checked when built: ConfigError naming `SandboxLimits.<field>`).

  max_files (files opened for writing plus directories created) with file_size_mb (the
  largest file the child may write, stdout / stderr included) bounds the disk a run can use
  to about (max_files + 2) x file_size_mb (the 2: stdout and stderr).
  """
  PATH = "SandboxLimits"
  timeout_s: float = ranged(2.0, "(0, 600]")  # wall clock
  cpu_s: int = ranged(1, "[1, 600]")  # CPU seconds
  memory_mb: int = ranged(256, "[64, 65536]")  # address space (Python itself needs ~30 MB)
  file_size_mb: int = ranged(4, "[1, 1024]")
  max_procs: int = ranged(0, "[0, 4096]", "0: no new processes or threads")  # RLIMIT_NPROC
  max_open_files: int = ranged(64, "[16, 4096]")  # RLIMIT_NOFILE
  max_files: int = ranged(32, "[1, 4096]")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What one run did.

  Attributes:
    exit_code: the child's return code (negative: killed by that signal).
    killed: None for a normal exit, else why it ended: "timeout" (wall clock), "cpu",
      "memory", "output" (file size), "violation" (the audit hook), "signal" (another
      signal), "error" (a non-zero exit with a Python exception).
    detail: the violation line or the last exception line, "" if none.
    stdout_tail, stderr_tail: the last TAIL_CHARS characters of each stream.
    wall_s: seconds from start to the end of the process group.
    disk_bytes: bytes the run left in its temp dir (stdout and stderr included), measured
      before the dir is deleted.
  """
  exit_code: int
  killed: str | None
  detail: str
  stdout_tail: str
  stderr_tail: str
  wall_s: float
  stdout: str = dataclasses.field(default="", repr=False)
  disk_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class CallsResult:
  """`run_calls`: per-call pass flags and the run itself.

  Attributes:
    passed: bool per call, in order (a call that did not report is False).
    run: the SandboxResult.
  """
  passed: tuple[bool, ...]
  run: SandboxResult

  @property
  def total(self) -> int:
    return len(self.passed)

  @property
  def num_passed(self) -> int:
    return sum(self.passed)

  @property
  def pass_rate(self) -> float:
    return self.num_passed / len(self.passed) if self.passed else 0.0


def _tail(path: str) -> str:
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError:
    return ""
  return data.decode("utf-8", "replace")


def _disk_bytes(directory: str) -> int:
  """Bytes allocated under `directory` (st_blocks: a sparse file counts what it uses)."""
  total = 0
  for d, dirs, files in os.walk(directory):
    for n in dirs + files:
      try:
        total += os.lstat(os.path.join(d, n)).st_blocks * 512
      except OSError:
        pass
  return total


def _classify(code: int, timed_out: bool, stderr: str) -> tuple[str | None, str]:
  last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
  if timed_out:
    return "timeout", ""
  if code == VIOLATION_EXIT:
    line = next((ln for ln in stderr.splitlines() if ln.startswith("[sandbox] denied")), last)
    return "violation", line
  if code < 0:
    sig = -code
    kind = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "output"}.get(sig, "signal")
    try:
      name = signal.Signals(sig).name
    except ValueError:
      name = f"signal {sig}"
    return kind, name
  if code != 0:
    if "MemoryError" in stderr:
      return "memory", last
    # CPython ignores SIGXFSZ, so a write past RLIMIT_FSIZE is an OSError (EFBIG) instead.
    if "[Errno 27]" in stderr:
      return "output", last
    return "error", last
  return None, ""


def _run(source: str, job: dict, limits: SandboxLimits) -> SandboxResult:
  if not isinstance(source, str):
    raise TypeError(f"sandbox source must be a str, got {type(source).__name__}")
  workdir = tempfile.mkdtemp(prefix="hmoe_sandbox_")
  start = time.monotonic()
  try:
    job = dict(job, limits=dataclasses.asdict(limits))
    with open(os.path.join(workdir, "job.json"), "w", encoding="utf-8") as f:
      json.dump(job, f)
    with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as f:
      f.write(source)
    out_path, err_path = (os.path.join(workdir, n) for n in ("stdout.txt", "stderr.txt"))
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
      # start_new_session: the child leads its own process group, so one killpg ends it
      # and anything it started (no preexec_fn: that is unsafe with threads in the parent).
      proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", BOOT], cwd=workdir, env=env,
                              stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                              start_new_session=True, close_fds=True)
      timed_out = False
      try:
        proc.wait(timeout=limits.timeout_s)
      except subprocess.TimeoutExpired:
        timed_out = True
      finally:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass
        proc.wait()
    wall = time.monotonic() - start
    stdout, stderr = _tail(out_path), _tail(err_path)
    killed, detail = _classify(proc.returncode, timed_out, stderr)
    return SandboxResult(proc.returncode, killed, detail, stdout[-TAIL_CHARS:],
                         stderr[-TAIL_CHARS:], wall, stdout, _disk_bytes(workdir))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
  """Runs `source` as a script (`__name__ == "__main__"`) in the sandbox."""
  return _run(source, {"mode": "script"}, limits)


def _canonical(value: Any) -> str:
  return json.dumps(value, sort_keys=True)


def run_calls(source: str, calls: Sequence[tuple[str, Sequence[Any]]],
              expected: Sequence[Any], limits: SandboxLimits = SandboxLimits()) -> CallsResult:
  """Defines `source`'s functions in the sandbox and checks `name(*args) == expected`.

  A call passes when its JSON return value equals the expected value exactly (same JSON:
  1 != 1.0 != true). Calls that raise, return something JSON cannot hold, or never run
  (the process was killed first) fail.

  Args:
    source: Python source defining the functions.
    calls: (function name, positional args) per call; args must be JSON-serialisable.
    expected: the expected return value per call (JSON-serialisable), same length.
    limits: SandboxLimits for the whole run (all calls share it).

  Raises:
    ValueError: calls and expected differ in length, or an arg / expected value is not
      JSON-serialisable (caller bugs, raised before anything runs).
  """
  if len(calls) != len(expected):
    raise ValueError(f"run_calls: {len(calls)} calls but {len(expected)} expected values")
  try:
    job_calls = [[str(name), json.dumps(list(args))] for name, args in calls]
    want = [_canonical(v) for v in expected]
  except (TypeError, ValueError) as e:
    raise ValueError(f"run_calls: a call's args or expected value is not JSON: {e}") from e
  nonce = secrets.token_hex(8)
  run = _run(source, {"mode": "calls", "nonce": nonce, "calls": job_calls}, limits)
  got: dict[int, str] = {}
  for line in run.stdout.splitlines():
    parts = line.split(" ", 2)
    if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit():
      # First report per index wins: the harness prints each index once, in order.
      got.setdefault(int(parts[1]), parts[2])
  passed = []
  for i, target in enumerate(want):
    text = got.get(i)
    ok = False
    if text is not None and not text.startswith("!"):
      try:
        ok = _canonical(json.loads(text)) == target
      except ValueError:
        ok = False
    passed.append(ok)
  return CallsResult(tuple(passed), run)
