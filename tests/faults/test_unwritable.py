"""Issue 33: a checkpoint directory the run cannot create anything in (read-only, or owned by
another user) must stop the run with one line naming the path, within seconds.

The tests run as root, which a chmod'ed directory does not stop, so the fault is raised at
the OS call (tests/faults/inject.py): every mkdir / create inside checkpoints/ fails with
EACCES. Before the fix the run printed its error line, then hung ~300 s at exit: orbax's
save threads waited for the step directory to appear (their coordination timeout).
"""

import subprocess
import threading
import time

import pytest

from tests.faults import helpers

EXIT_WITHIN_S = 30.0


def _run_until_error(fault: str, workdir, cache_dir, timeout=300.0):
  """(output, seconds from the first `error:` line to the process's exit)."""
  proc = subprocess.Popen(helpers.injected_cmd(fault, *helpers.train_args(workdir)),
                          cwd=helpers.ROOT, env=helpers.subprocess_env(cache_dir),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines, error_at = [], []

  def read():
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("error:") and not error_at:
        error_at.append(time.monotonic())

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    proc.wait(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  reader.join(5)
  ended = time.monotonic()
  return "".join(lines), (ended - error_at[0]) if error_at else None


def _check_one_line(out: str, lag, workdir):
  errors = helpers.error_lines(out)
  assert len(errors) == 1, out[-3000:]
  assert lag is not None and lag < EXIT_WITHIN_S, f"exit {lag} s after the error line"
  assert "permission denied" in errors[0] and f"{workdir}/checkpoints" in errors[0], errors
  assert "Traceback" not in out and "never awaited" not in out


def test_step_directory_cannot_be_created_exits_at_once(tmp_path):
  """checkpoints/ exists (the start-up probe passes) but each step's directory cannot be
  created: the first save fails and the run exits within seconds, not ~300 s."""
  workdir = tmp_path / "run"
  out, lag = _run_until_error("ro_steps", workdir, tmp_path / "cache")
  _check_one_line(out, lag, workdir)
  assert "checkpoint step 2" in helpers.error_lines(out)[0]
  assert helpers.committed_steps(workdir) == []


@pytest.mark.slow
def test_read_only_checkpoints_refused_before_training(tmp_path):
  """Nothing can be created in checkpoints/: refused at start, before any compile, and the
  checkpoints already there are kept byte-identical."""
  cache = tmp_path / "cache"
  workdir = tmp_path / "run"
  r = helpers.run_train(workdir, "--config.train.steps=4", cache_dir=cache)
  assert r.returncode == 0, r.stdout[-3000:]
  kept = helpers.all_hashes(workdir)
  assert sorted(kept) == [2, 4]
  out, lag = _run_until_error("ro_checkpoints", workdir, cache)
  _check_one_line(out, lag, workdir)
  assert "nothing was trained" in helpers.error_lines(out)[0]
  assert "training steps" not in out
  helpers.assert_kept(workdir, kept)
