"""Run untrusted Python (model-written code) in a sandbox the operating system enforces.

`run_python(source)` runs a script; `run_calls(source, calls, expected)` defines the
solution's functions, calls each (name, args) and compares the results with `expected` in
THIS process (the expected values never reach the child, so printing cannot fake a pass).

Default isolation, SandboxLimits(isolation="namespaces"): `rl/sandbox_ns.py` runs each
program in new user, PID, mount, network, IPC, UTS and cgroup namespaces. Guaranteed by the
kernel, whatever the code does (RELIABILITY.md, "The RL code sandbox, enforced by the
kernel", says how each is enforced; rl/sandbox_ns.py, how each is built):
  - it sees only a read-only view of what `python -I -S` needs (/usr, the /lib* and /bin
    trees, the interpreter's prefix, the boot script), its own /proc (its processes only:
    not this process, not the host's), a /dev of null / zero / full / random / urandom;
  - its only writable place is one tmpfs (noexec) seen as its cwd /sandbox, /tmp and
    /dev/shm, at most max_files x file_size_mb bytes (plus the job's two files) and
    max_files inodes more than it starts with; stdout and stderr are files opened here,
    each capped by RLIMIT_FSIZE; nothing it writes outlives the run (the tmpfs dies with the
    namespace);
  - no network (an empty network namespace; sockets other than AF_UNIX refused), no IPC
    with anything outside, no signal / ptrace / priority / pidfd reaching a process outside
    the run, and it dies with this process (PR_SET_PDEATHSIG);
  - runs as an unprivileged uid (outside: 65534 when this process is root and has that
    id, else this process's uid) with no capability over any namespace, no_new_privs, and a seccomp
    filter (rl/sandbox_seccomp.py) refusing mount, namespace, module, keyring, bpf, perf,
    io_uring, ptrace and similar calls;
  - CPU seconds (RLIMIT_CPU, per process), address space (RLIMIT_AS), file size, open
    files, processes and threads (RLIMIT_NPROC = max_procs + 1, counted in the run's own
    user namespace), no core dumps; a wall clock, after which, and after every normal exit,
    every process of the run is killed (the PID namespace ends with its init).
Not guaranteed: safety from kernel bugs, side channels (timing, CPU caches), CPU time and
memory of a forked tree as a whole (RLIMIT_CPU and RLIMIT_AS are per process; cgroups are
not used: `isolation().notes` says which cgroup v2 controllers this machine offers). The audit hook of
rl/sandbox_boot.py still runs inside, as a cheap first layer that names what it stops.

Where the kernel refuses namespaces (or a mount step, or the machine has no seccomp table:
x86_64 and aarch64 have one), every run raises SandboxUnavailable with one line
naming the failed step and errno (probed once per process: `isolation()`); nothing falls
back silently. SandboxLimits(isolation="audit-hook") is the explicit opt-out: the old mode
(a temp dir as cwd, rlimits, the audit hook; a RuntimeWarning says it is NOT a security
boundary: it can be switched off from inside).

Results never raise for what the code does: the caller gets a SandboxResult with `killed`
set ("timeout", "cpu", "memory", "output", "violation", "signal", "error") and continues.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Sequence

from hybridmoe_jax.config import Checked, ranged

_HERE = os.path.dirname(os.path.abspath(__file__))
BOOT = os.path.join(_HERE, "sandbox_boot.py")
NS_STAGE = os.path.join(_HERE, "sandbox_ns.py")
VIOLATION_EXIT = 86          # sandbox_boot.VIOLATION_EXIT (kept equal by a test)
SETUP_EXIT = 87              # sandbox_ns.SETUP_EXIT (kept equal by a test)
TAIL_CHARS = 2000
ISOLATIONS = ("namespaces", "audit-hook")
# The namespaced run's init kills everything at the deadline itself; this process waits
# that much longer before killing stage 0's process group (a backstop, never the rule).
BACKSTOP_S = 1.0
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}


class SandboxUnavailable(RuntimeError):
  """The kernel refuses the namespaced sandbox; the message is one line naming the step
  that failed (and its errno) and the opt-out."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits(Checked):
  """Per-run limits (checked when built: ConfigError naming `SandboxLimits.<field>`).

  max_files (files opened for writing plus directories created) with file_size_mb (the
  largest file the child may write, stdout / stderr included) bounds the disk a run can use
  to about (max_files + 2) x file_size_mb (the 2: stdout and stderr); with namespaces the
  writable tmpfs enforces it (size and inodes), without them only the audit hook counts.
  isolation: "namespaces" (the default: the kernel's walls, see the module docstring) or
  "audit-hook" (the opt-out where namespaces are unavailable: NOT a security boundary).
  """
  PATH = "SandboxLimits"
  timeout_s: float = ranged(2.0, "(0, 600]")  # wall clock
  cpu_s: int = ranged(1, "[1, 600]")  # CPU seconds
  memory_mb: int = ranged(256, "[64, 65536]")  # address space (Python itself needs ~30 MB)
  file_size_mb: int = ranged(4, "[1, 1024]")
  max_procs: int = ranged(0, "[0, 4096]", "0: no new processes or threads")  # RLIMIT_NPROC
  max_open_files: int = ranged(64, "[16, 4096]")  # RLIMIT_NOFILE
  max_files: int = ranged(32, "[1, 4096]")
  isolation: str = ranged("namespaces", ISOLATIONS,
                          "audit-hook: no OS isolation, NOT a security boundary")


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
    wall_s: seconds from start to the end of the run's last process.
    disk_bytes: bytes the run left in its writable places (namespaces: the tmpfs; the
      audit-hook mode: its temp dir) plus stdout and stderr, measured at its end.
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
    # SIGSYS: the seccomp filter killed a call made under a foreign architecture.
    kind = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "output",
            signal.SIGSYS: "violation"}.get(sig, "signal")
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


@dataclasses.dataclass(frozen=True)
class Isolation:
  """What this machine's kernel gives the namespaced sandbox (`isolation()`).

  Attributes:
    available: a namespaced run works here.
    missing: "" if available, else the one line naming the step that failed and its errno.
    notes: what namespaced runs go without here (no procfs, no delegated cgroup v2, ...).
  """
  available: bool
  missing: str
  notes: tuple[str, ...]


def _cgroup_note() -> str:
  """Which of the memory / pids / cpu controllers the cgroup v2 hierarchy offers at this
  process's cgroup (the sandbox uses none either way: its limits are per-process rlimits)."""
  try:
    with open("/proc/self/cgroup", encoding="utf-8") as f:
      lines = f.read().splitlines()
    own = next(ln[3:] for ln in lines if ln.startswith("0::"))
    unified = "/sys/fs/cgroup" if len(lines) == 1 else "/sys/fs/cgroup/unified"
    with open(f"{unified}{own.rstrip('/')}/cgroup.controllers", encoding="utf-8") as f:
      controllers = f.read().split()
  except (OSError, StopIteration):
    return "cgroups: no cgroup v2 hierarchy; per-process rlimits only"
  kind = "cgroup v2" if len(lines) == 1 else "v1/hybrid cgroup hierarchy"
  have = [c for c in ("memory", "pids", "cpu") if c in controllers]
  return (f"cgroups: {kind}, controllers {' '.join(have) or 'none'} of memory/pids/cpu here; "
          "not used: CPU, memory and process limits are per-process rlimits")


@functools.cache
def _probe() -> Isolation:
  """One namespaced run of `pass` (cached: once per process)."""
  try:
    result, report = _execute("pass", {"mode": "script"}, SandboxLimits(timeout_s=30.0))
  except SandboxUnavailable as e:
    return Isolation(False, str(e.args[0]), ())
  if result.killed or "status" not in report:
    how = result.killed or "without a report"
    why = result.detail or result.stderr_tail.strip()[-200:]
    return Isolation(False, f"a namespaced run of `pass` ended {how} (exit "
                     f"{result.exit_code}): {why}", ())
  notes = [_cgroup_note()]
  if not report.get("proc"):
    notes.append("procfs: the kernel refused a fresh /proc; runs have none and their payload "
                 "keeps init's user namespace (seccomp still refuses every mount call)")
  return Isolation(True, "", tuple(notes))


def isolation() -> Isolation:
  """What the kernel gives the namespaced sandbox here (probed once per process)."""
  return _probe()


@functools.cache
def _warn_audit_hook() -> None:
  warnings.warn("sandbox: SandboxLimits(isolation='audit-hook') runs untrusted code with an "
                "audit hook only, which code can switch off from inside: NOT a security "
                "boundary", RuntimeWarning, stacklevel=5)


def require_isolation(limits: SandboxLimits) -> None:
  """Raises SandboxUnavailable (one line: what failed, errno, the opt-out) when `limits`
  asks for namespaces and the kernel refuses them; warns once for the audit-hook mode."""
  if limits.isolation == "audit-hook":
    _warn_audit_hook()
    return
  iso = _probe()
  if not iso.available:
    raise SandboxUnavailable(
        f"sandbox: the kernel refuses the namespaced sandbox ({iso.missing}); to run "
        "without OS isolation set SandboxLimits(isolation='audit-hook'): an audit hook "
        "only, NOT a security boundary")


def _wait_for_exit(proc: subprocess.Popen, timeout: float) -> bool:
  """Waits until `proc` exits or `timeout` seconds pass; True if the time ran out. A pidfd
  wakes this at the exit itself (Popen.wait(timeout) polls, up to 50 ms late)."""
  try:
    pidfd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):   # no pidfd (Linux < 5.3): poll
    try:
      proc.wait(timeout=timeout)
      return False
    except subprocess.TimeoutExpired:
      return True
  try:
    return not select.select([pidfd], [], [], timeout)[0]
  finally:
    os.close(pidfd)


def _read_report(path: str) -> dict:
  """The namespaced run's report lines merged (a setup error wins)."""
  merged: dict = {}
  try:
    with open(path, encoding="utf-8") as f:
      for line in f:
        try:
          merged.update(json.loads(line))
        except ValueError:
          pass
  except OSError:
    pass
  return merged


def _execute(source: str, job: dict, limits: SandboxLimits) -> tuple[SandboxResult, dict]:
  """One run in the mode `limits.isolation` names; (the result, the init's report)."""
  namespaced = limits.isolation == "namespaces"
  workdir = tempfile.mkdtemp(prefix="hmoe_sandbox_")
  start = time.monotonic()
  try:
    job = dict(job, limits=dataclasses.asdict(limits))
    with open(os.path.join(workdir, "job.json"), "w", encoding="utf-8") as f:
      json.dump(job, f)
    with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as f:
      f.write(source)
    out_path, err_path, report_path = (os.path.join(workdir, n) for n in
                                       ("stdout.txt", "stderr.txt", "report.jsonl"))
    with open(out_path, "wb") as out, open(err_path, "wb") as err, \
        open(report_path, "wb") as rep:
      if namespaced:
        cmd = [NS_STAGE, workdir, str(rep.fileno()), str(os.getpid()),
               repr(start + limits.timeout_s)]
        pass_fds, wait_s = (rep.fileno(),), limits.timeout_s + BACKSTOP_S
      else:
        cmd, pass_fds, wait_s = [BOOT], (), limits.timeout_s
      # start_new_session: the child leads its own process group, so one killpg ends it
      # (and, namespaced, its PID namespace's init, whose end kills every process of the
      # run); no preexec_fn: that is unsafe with threads in the parent.
      proc = subprocess.Popen([sys.executable, "-I", "-S", "-B"] + cmd, cwd=workdir, env=_ENV,
                              stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                              start_new_session=True, close_fds=True, pass_fds=pass_fds)
      try:
        timed_out = _wait_for_exit(proc, wait_s)
      finally:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass
        proc.wait()
    wall = time.monotonic() - start
    stdout, stderr = _tail(out_path), _tail(err_path)
    code, disk, report = proc.returncode, _disk_bytes(workdir), {}
    if namespaced:
      report = _read_report(report_path)
      if "setup_error" in report:
        raise SandboxUnavailable(report["setup_error"])
      if "status" in report:   # else stage 0 ended without it: its own code stands
        code = os.waitstatus_to_exitcode(report["status"])
        timed_out = timed_out or report["timeout"]
        disk += report["disk"]
    killed, detail = _classify(code, timed_out, stderr)
    return SandboxResult(code, killed, detail, stdout[-TAIL_CHARS:], stderr[-TAIL_CHARS:],
                         wall, stdout, disk), report
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _run(source: str, job: dict, limits: SandboxLimits) -> SandboxResult:
  if not isinstance(source, str):
    raise TypeError(f"sandbox source must be a str, got {type(source).__name__}")
  require_isolation(limits)
  return _execute(source, job, limits)[0]


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
  """Runs `source` as a script (`__name__ == "__main__"`) in the sandbox.

  Raises:
    SandboxUnavailable: limits.isolation is "namespaces" and the kernel refuses them.
  """
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
    SandboxUnavailable: limits.isolation is "namespaces" and the kernel refuses them.
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
    # isdecimal, not isdigit: int() refuses digits such as '²' that isdigit accepts.
    if len(parts) == 3 and parts[0] == nonce and parts[1].isdecimal():
      # First report per index wins: the harness prints each index once, in order.
      got.setdefault(int(parts[1]), parts[2])
  passed = []
  for i, target in enumerate(want):
    text = got.get(i)
    ok = False
    if text is not None and not text.startswith("!"):
      try:
        ok = _canonical(json.loads(text)) == target
      except (ValueError, RecursionError):   # not JSON, or nested past the parser's depth
        ok = False
    passed.append(ok)
  return CallsResult(tuple(passed), run)
