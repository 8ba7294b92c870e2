"""Trial 4: runs competing for one workdir. A live holder refuses a second run with one
line before it touches anything; stale locks (a dead PID on this host, another host's lock
without a heartbeat) are taken over with a warning; another host's fresh lock is refused."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hybridmoe_jax.cli import workdir_lock
from tests.faults import helpers


def _write_lock(workdir, **record):
  path = os.path.join(workdir, workdir_lock.LOCK_FILE)
  with open(path, "w") as f:
    json.dump({"started": "then", **record}, f)
  return path


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()  # reaped: the PID names no process now (until the kernel reuses it)
  return p.pid


def _listing(workdir):
  """Every file with its mtime, but the lock's (its holder's heartbeat touches it)."""
  out = []
  for d, _, names in os.walk(workdir):
    for n in names:
      path = os.path.join(d, n)
      out.append((os.path.relpath(path, workdir),
                  None if n == workdir_lock.LOCK_FILE else os.path.getmtime(path)))
  return sorted(out)


def test_live_holder_refuses_a_second_run_before_it_touches_anything(tmp_path):
  with workdir_lock.WorkdirLock(str(tmp_path)):
    before = _listing(tmp_path)
    lock_text = (tmp_path / workdir_lock.LOCK_FILE).read_text()
    r = helpers.run_train(tmp_path)
    assert r.returncode == 1, r.stdout[-3000:]
    errors = helpers.error_lines(r.stdout)
    assert len(errors) == 1 and errors[0].startswith(f"error: workdir {tmp_path} is in use by "
                                                     f"another run (pid {os.getpid()} on host")
    assert "Traceback" not in r.stdout
    assert _listing(tmp_path) == before     # no checkpoints/, metrics.jsonl or config written
    assert (tmp_path / workdir_lock.LOCK_FILE).read_text() == lock_text


@pytest.mark.parametrize("holder", ["dead_pid_here", "old_other_host"])
def test_stale_lock_is_taken_over_with_a_warning(tmp_path, holder):
  if holder == "dead_pid_here":
    path = _write_lock(tmp_path, host=socket.gethostname(), pid=_dead_pid())
  else:
    path = _write_lock(tmp_path, host="elsewhere.invalid", pid=1)
    old = time.time() - 3600
    os.utime(path, (old, old))
  with helpers.LogLines() as log:
    with workdir_lock.WorkdirLock(str(tmp_path), stale_after_s=600):
      mine = json.loads(open(path).read())
      assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
  warnings = [l for l in log.messages() if "took over the stale lock" in l]
  assert len(warnings) == 1, log.messages()
  assert not os.path.exists(path)            # released at the end
  assert len([n for n in os.listdir(tmp_path) if ".stale-" in n]) == 1  # the record is kept


def test_fresh_lock_of_another_host_is_refused(tmp_path):
  path = _write_lock(tmp_path, host="elsewhere.invalid", pid=1)
  with pytest.raises(workdir_lock.WorkdirBusy, match="in use by another run .pid 1 on host "
                     "elsewhere.invalid"):
    workdir_lock.WorkdirLock(str(tmp_path), stale_after_s=600).acquire()
  assert json.loads(open(path).read())["host"] == "elsewhere.invalid"  # left alone


@pytest.mark.slow
def test_two_runs_started_together_exactly_one_trains(tmp_path):
  logs = [open(tmp_path / f"run{i}.log", "w+") for i in range(2)]
  procs = [helpers.start_train(tmp_path / "w", log=f) for f in logs]
  rcs = sorted(p.wait(timeout=600) for p in procs)
  outs = [open(tmp_path / f"run{i}.log").read() for i in range(2)]
  assert rcs == [0, 1], [o[-2000:] for o in outs]
  loser = outs[[p.returncode for p in procs].index(1)]
  errors = helpers.error_lines(loser)
  assert len(errors) == 1 and "is in use by another run" in errors[0], loser[-2000:]
  assert "training steps" not in loser       # it never reached the training loop
  starts = [e for e in helpers.metrics_events(tmp_path / "w") if e.get("event")]
  assert [e["event"] for e in starts] == ["start"]
  assert helpers.committed_steps(tmp_path / "w") == [2, 4, 6, 8]
