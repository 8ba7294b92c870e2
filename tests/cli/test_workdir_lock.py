"""The workdir lock: one live run per workdir, stale locks taken over, never two winners."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from hybridmoe_jax.cli import workdir_lock
from hybridmoe_jax.cli.workdir_lock import LOCK_FILE, WorkdirBusy, WorkdirLock


def _write_lock(workdir, **record):
  path = workdir / LOCK_FILE
  path.write_text(json.dumps(record))
  return path


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def test_second_holder_is_refused_and_release_frees(tmp_path):
  with WorkdirLock(str(tmp_path)):
    record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(WorkdirBusy, match=rf"in use by another run \(pid {os.getpid()} on "
                                          rf"host {socket.gethostname()}"):
      WorkdirLock(str(tmp_path)).acquire()
  assert not (tmp_path / LOCK_FILE).exists()
  with WorkdirLock(str(tmp_path)):      # free again
    pass


def test_dead_process_on_this_host_is_stale(tmp_path, caplog):
  _write_lock(tmp_path, host=socket.gethostname(), pid=_dead_pid(), started="earlier")
  with WorkdirLock(str(tmp_path)):
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
  assert "took over the stale lock" in caplog.text and "is not running" in caplog.text
  kept = [n for n in os.listdir(tmp_path) if n.startswith(LOCK_FILE + ".stale-")]
  assert len(kept) == 1                 # the old record is kept, not deleted


def test_reused_pid_is_stale(tmp_path):
  """A live PID whose start time differs from the recorded one is another process."""
  _write_lock(tmp_path, host=socket.gethostname(), pid=os.getpid(), proc_start="1")
  with WorkdirLock(str(tmp_path)):
    pass


def test_other_host_by_heartbeat(tmp_path):
  path = _write_lock(tmp_path, host="elsewhere-host", pid=1, started="earlier")
  with pytest.raises(WorkdirBusy, match="elsewhere-host"):   # fresh heartbeat: alive
    WorkdirLock(str(tmp_path), stale_after_s=600).acquire()
  old = time.time() - 3600
  os.utime(path, (old, old))
  with WorkdirLock(str(tmp_path), stale_after_s=600):         # an hour without one: stale
    pass


def test_heartbeat_refreshes_mtime(tmp_path):
  with WorkdirLock(str(tmp_path), heartbeat_s=0.05):
    path = tmp_path / LOCK_FILE
    old = time.time() - 3600
    os.utime(path, (old, old))
    time.sleep(0.5)
    assert time.time() - path.stat().st_mtime < 5


def test_racing_processes_never_hold_it_together(tmp_path):
  """Eight processes race for one stale lock; the intervals in which each held it (written
  by the holders) never overlap."""
  _write_lock(tmp_path, host=socket.gethostname(), pid=_dead_pid())
  module = pathlib.Path(workdir_lock.__file__)
  # The module alone (absl only): importing hybridmoe_jax.train would load jax 8 times.
  script = (
      "import importlib.util, sys, time\n"
      f"spec = importlib.util.spec_from_file_location('wl', {str(module)!r})\n"
      "wl = importlib.util.module_from_spec(spec); spec.loader.exec_module(wl)\n"
      "try:\n"
      "  with wl.WorkdirLock(sys.argv[1]):\n"
      "    t0 = time.time(); time.sleep(0.3); t1 = time.time()\n"
      "  print('won', t0, t1, flush=True)\n"
      "except wl.WorkdirBusy:\n"
      "  print('busy', flush=True)\n")
  procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True) for _ in range(8)]
  outs = [p.communicate(timeout=120)[0].split() for p in procs]
  assert all(o and o[0] in ("won", "busy") for o in outs), outs
  held = sorted((float(o[1]), float(o[2])) for o in outs if o[0] == "won")
  assert held, outs
  for (_, end), (start, _) in zip(held, held[1:]):
    assert start >= end, held        # one holder at a time
