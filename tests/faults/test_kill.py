"""Trials 1 and 6: `run_train.py` killed (SIGKILL) at seeded random points of training and
of a save, or stopped by SIGINT / SIGTERM; then resumed to the end.

Each trial asserts that the resumed run's losses equal the uninterrupted reference run's
bitwise (CPU runs are deterministic) and that every checkpoint committed before the fault
is still in checkpoints/, byte-identical. Subprocesses share a persistent compile cache, so
only the reference run compiles. Slow (a subprocess run is ~10-60 s on 2 busy cores).
"""

import os
import random
import signal
import time

import pytest

from tests.faults import helpers

SOAK_SEEDS = range(10)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
  workdir = tmp_path_factory.mktemp("ref")
  r = helpers.run_train(workdir, cache_dir=cache_dir)
  assert r.returncode == 0, r.stdout[-3000:]
  assert helpers.committed_steps(workdir) == [2, 4, 6, 8]
  return helpers.train_losses(workdir)


def _first_train_record(workdir, proc, timeout=300.0) -> bool:
  """Wait until the run logged its first step (compiled, training); False if it ended."""
  end = time.time() + timeout
  while time.time() < end and proc.poll() is None:
    if any(r.get("split") == "train" for r in helpers.metrics_events(workdir)):
      return True
    time.sleep(0.01)
  return False


def _kill_in_save(workdir, proc, nth: int, timeout=300.0) -> bool:
  """SIGKILL as soon as the temporary directory of the `nth` (0-based) checkpoint save
  appears; False if the run ended before."""
  ckpts = os.path.join(workdir, "checkpoints")
  seen = set()
  end = time.time() + timeout
  while time.time() < end and proc.poll() is None:
    try:
      names = os.listdir(ckpts)
    except FileNotFoundError:
      names = []
    seen.update(n.split(".")[0] for n in names if ".orbax-checkpoint-tmp" in n)
    if len(seen) > nth:
      proc.send_signal(signal.SIGKILL)
      return True
  return False


def _resume_and_check(workdir, cache_dir, reference, committed) -> None:
  r = helpers.run_train(workdir, cache_dir=cache_dir)
  assert r.returncode == 0, r.stdout[-3000:]
  assert helpers.train_losses(workdir) == reference
  helpers.assert_kept(workdir, committed)
  assert helpers.committed_steps(workdir)[-1] == 8


@pytest.mark.parametrize("seed", SOAK_SEEDS)
def test_sigkill_then_resume(tmp_path, cache_dir, reference, seed):
  """Odd seeds kill inside a save: when the temporary directory of a seeded one of the 4
  saves (steps 2, 4, 6, 8) appears. Even seeds kill at a seeded uniform time in the first
  2 s of training (its 8 steps take ~1-3 s)."""
  rng = random.Random(seed)
  workdir = tmp_path / "run"
  with open(tmp_path / "killed.log", "w") as log:
    proc = helpers.start_train(workdir, cache_dir=cache_dir, log=log)
    if seed % 2:
      hit = _kill_in_save(workdir, proc, nth=rng.randrange(4))
    else:
      hit = _first_train_record(workdir, proc)
      time.sleep(rng.uniform(0.0, 2.0))
      proc.send_signal(signal.SIGKILL)
    rc = proc.wait(timeout=300)
  # Read after the kill: the process is gone, so this is exactly what it left behind.
  committed = helpers.all_hashes(workdir)
  print(f"seed {seed}: {'in a save' if seed % 2 else 'in training'} hit={hit} rc={rc} "
        f"committed={sorted(committed)}")
  _resume_and_check(workdir, cache_dir, reference, committed)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_after_clean_save_exits_128_plus_n(tmp_path, cache_dir, reference, sig, code):
  workdir = tmp_path / "run"
  with open(tmp_path / "stopped.log", "w") as log:
    proc = helpers.start_train(workdir, cache_dir=cache_dir, log=log)
    assert _first_train_record(workdir, proc)
    proc.send_signal(sig)
    rc = proc.wait(timeout=300)
  out = (tmp_path / "stopped.log").read_text()
  assert rc == code, out[-3000:]
  assert not helpers.error_lines(out)
  committed = helpers.all_hashes(workdir)
  stopped_at = max(r["step"] for r in helpers.metrics_events(workdir) if "loss" in r)
  assert max(committed) == stopped_at   # the stop saved the step it finished
  assert stopped_at < 8   # signalled after its first step, long before the end
  r = helpers.run_train(workdir, cache_dir=cache_dir)
  assert r.returncode == 0, r.stdout[-3000:]
  assert helpers.train_losses(workdir) == reference
  helpers.assert_kept(workdir, committed)
