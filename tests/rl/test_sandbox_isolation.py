"""The namespaced sandbox's own promises: the payload's identity, the refusal where the
kernel has no namespaces (simulated, and real: a user namespace allowed none), the opt-out."""

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest

from hybridmoe_jax.rl import sandbox, sandbox_ns
from hybridmoe_jax.rl.envs.code import CodeEnv
from hybridmoe_jax.rl.sandbox import SandboxLimits, SandboxUnavailable, run_calls, run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFUSED = sandbox.Isolation(False, "unshare(CLONE_NEWUSER) failed: EPERM (Operation not "
                            "permitted)", ())


def test_the_payload_has_no_privilege():
  r = run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups(), os.getcwd())\n"
                 "print(open('/proc/self/status').read())")
  assert r.killed is None, r.stderr_tail
  ids, status = r.stdout.split("\n", 1)
  assert ids == "1000 1000 [] /sandbox"
  fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
  assert fields["CapEff"] == fields["CapPrm"] == fields["CapAmb"] == "0000000000000000"
  assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2", fields
  assert sandbox.SETUP_EXIT == sandbox_ns.SETUP_EXIT


def test_outside_the_run_is_an_unprivileged_uid():
  """Seen from the host, the run's processes belong to 65534 (this process is root) or to
  this process's uid, never to root."""
  marker = uuid.uuid4().hex
  thread = threading.Thread(target=run_python, args=(
      f"import time\nprint({marker!r})\ntime.sleep(1.5)",))
  thread.start()
  uids, deadline = set(), time.monotonic() + 10
  while not uids and time.monotonic() < deadline:
    for pid in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          if f.read().split(b"\0")[-2:-1] != [b"/sandbox_boot.py"]:
            continue
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
          uids |= {line for line in f if line.startswith(("Uid:", "Gid:"))}
      except (OSError, IndexError):
        pass
    time.sleep(0.05)
  thread.join()
  want = 65534 if os.geteuid() == 0 else os.geteuid()
  assert uids and all(set(line.split()[1:]) == {str(want)} for line in uids), uids


def test_refusal_is_one_line_naming_the_failure_and_the_opt_out(monkeypatch):
  monkeypatch.setattr(sandbox, "_probe", lambda: REFUSED)
  for call in (lambda: run_python("print(1)"),
               lambda: run_calls("def f():\n  return 1\n", [("f", [])], [1]),
               CodeEnv):
    with pytest.raises(SandboxUnavailable) as e:
      call()
    msg = str(e.value)
    assert "\n" not in msg and "unshare(CLONE_NEWUSER) failed: EPERM" in msg, msg
    assert "SandboxLimits(isolation='audit-hook')" in msg and "NOT a security boundary" in msg
  # The documented opt-out runs (with a warning), in the code environment too.
  opt_out = SandboxLimits(isolation="audit-hook")
  with pytest.warns(RuntimeWarning, match="NOT a security boundary"):
    sandbox._warn_audit_hook.cache_clear()
    r = run_python("print(6 * 7)", opt_out)
  assert r.killed is None and r.stdout == "42\n"
  env = CodeEnv(limits=opt_out)
  assert env.limits.isolation == "audit-hook"
  with pytest.raises(ValueError, match="`SandboxLimits.isolation` = 'none'"):
    SandboxLimits(isolation="none")


def test_a_failing_setup_step_becomes_the_refusal(monkeypatch):
  """The probe turns a stage's setup error (what the namespaced stage reports when a step
  fails) into the refusal; it runs once per process (cached)."""
  calls = []

  def failing_execute(source, job, limits):
    calls.append(limits.isolation)
    raise SandboxUnavailable("mount(proc on /tmp/x/proc, proc) failed: EPERM (Operation not "
                             "permitted)")
  monkeypatch.setattr(sandbox, "_execute", failing_execute)
  sandbox._probe.cache_clear()
  try:
    for _ in range(3):
      with pytest.raises(SandboxUnavailable, match=r"\(mount\(proc on .* failed: EPERM"):
        run_python("print(1)")
    assert calls == ["namespaces"]
    assert not sandbox.isolation().available
  finally:
    sandbox._probe.cache_clear()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_kernel_without_user_namespaces_is_refused_for_real():
  """In a user namespace whose max_user_namespaces is 0, unshare(CLONE_NEWUSER) fails with
  ENOSPC: the real refusal path, end to end; the opt-out still runs there."""
  code = ("import warnings\nfrom hybridmoe_jax.rl import sandbox\n"
          "try:\n  sandbox.run_python('print(1)')\n"
          "except sandbox.SandboxUnavailable as e:\n  print('REFUSED', e)\n"
          "warnings.simplefilter('ignore')\n"
          "print(sandbox.run_python('print(6 * 7)', "
          "sandbox.SandboxLimits(isolation='audit-hook')).stdout, end='')\n")
  script = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c \"$0\""
  out = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script, code],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
  lines = out.stdout.splitlines()
  assert len(lines) == 2, (out.stdout, out.stderr[-2000:])
  assert lines[0].startswith("REFUSED sandbox: the kernel refuses the namespaced sandbox "
                             "(unshare(CLONE_NEWUSER) failed: ENOSPC"), lines[0]
  assert lines[1] == "42"
