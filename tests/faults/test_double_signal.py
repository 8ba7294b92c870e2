"""Issue 33: a second SIGINT while the run saves after the first printed a 100-line
KeyboardInterrupt traceback from inside orbax. Now it is one line, exit 130 at once; the
unfinished checkpoint is set aside on the next start (as after a SIGKILL), every committed
one is kept byte-identical, and the rerun finishes."""

import os
import signal
import time

import pytest

from tests.faults import helpers

pytestmark = pytest.mark.slow


def test_second_sigint_during_the_save_is_one_line_and_loses_nothing(tmp_path):
  workdir, cache = tmp_path / "run", tmp_path / "cache"
  proc = helpers.start_train(workdir, "--config.train.steps=400",
                             "--config.train.checkpoint_every=0", cache_dir=cache)
  end = time.time() + 300
  while time.time() < end and proc.poll() is None and not any(
      r.get("split") == "train" for r in helpers.metrics_events(workdir)):
    time.sleep(0.01)
  assert proc.poll() is None, proc.stdout.read()[-3000:]
  proc.send_signal(signal.SIGINT)       # save after this step, then exit 130 ...
  ckpts = os.path.join(workdir, "checkpoints")
  while time.time() < end and proc.poll() is None and not any(
      ".orbax-checkpoint-tmp" in n for n in os.listdir(ckpts)):
    time.sleep(0.001)
  proc.send_signal(signal.SIGINT)       # ... and again while that save is being written
  out = proc.communicate(timeout=120)[0]
  errors = helpers.error_lines(out)
  assert proc.returncode == 130, out[-3000:]
  assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
  assert len(errors) == 1 and "received SIGINT again" in errors[0], out[-3000:]
  assert not os.path.exists(workdir / "run.lock")    # released on the way out
  kept = helpers.all_hashes(workdir)
  target = max(kept, default=0) + 4
  r = helpers.run_train(workdir, f"--config.train.steps={target}", cache_dir=cache)
  assert r.returncode == 0, r.stdout[-3000:]
  helpers.assert_kept(workdir, kept)
  assert helpers.committed_steps(workdir)[-1] == target
