"""Trial 3: the disk fills up during a save (in-process, injected into orbax's writer).

ENOSPC is raised where orbax writes a step's files, in its background commit thread, as a
full disk would. The run must stop with one line naming the workdir and "no space", keep
every earlier checkpoint, leave no partial step where the next start would read it, and a
resume (with space again) must continue exactly.
"""

import errno
import subprocess

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests.faults import helpers

FULL_AT = 6  # the save of this step hits the full disk


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return helpers.reference_run(tmp_path_factory.mktemp("ref"))


def test_disk_full_during_save_stops_cleanly_and_resumes_exactly(reference, tmp_path,
                                                                  monkeypatch):
  config, workdir = reference["config"], tmp_path / "run"
  real_save = json_checkpoint_handler.JsonCheckpointHandler._save_fn

  async def full_disk(self, x, directory):
    if isinstance(x, dict) and x.get("step") == FULL_AT:
      raise OSError(errno.ENOSPC, "No space left on device", str(directory / "metadata"))
    return await real_save(self, x, directory)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", full_disk)
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    train_and_evaluate(run_config_from_dict(config), str(workdir), data=helpers.fake_data(config))
  message = str(e.value)
  assert "\n" not in message and "no space" in message.lower() and str(workdir) in message
  assert helpers.committed_steps(workdir) == [2, 4]
  kept = helpers.all_hashes(workdir)
  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", real_save)

  with helpers.LogLines() as log:
    s = train_and_evaluate(run_config_from_dict(config), str(workdir),
                           data=helpers.fake_data(config))
  assert s["start_step"] == 4 and s["end_step"] == 8
  helpers.assert_kept(workdir, kept)
  # The unfinished step 6 was set aside (not read, not deleted), with one warning.
  partial = [l for l in log.messages() if "partial checkpoint" in l]
  assert len(partial) <= 1
  assert not [n for n in (workdir / "checkpoints").iterdir() if not n.name.isdigit()]
  assert helpers.train_losses(workdir) == reference["losses"]
  for a, b in zip(jax.tree.leaves(reference["summary"]["state"]), jax.tree.leaves(s["state"])):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_real_full_disk_through_run_train(tmp_path):
  """run_train.py on a 1000 KiB tmpfs (two of the tiny run's ~380 KiB checkpoints fit),
  then on the same tmpfs grown to 16 MiB: one error line, then an exact resume."""
  mnt = tmp_path / "small_disk"
  mnt.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1000k", "tmpfs", str(mnt)],
                    capture_output=True, check=False).returncode:
    pytest.skip("cannot mount a tmpfs here (needs root)")
  try:
    ref = helpers.run_train(tmp_path / "ref", cache_dir=tmp_path / "cache")
    assert ref.returncode == 0, ref.stdout[-3000:]
    workdir = mnt / "run"
    r = helpers.run_train(workdir, cache_dir=tmp_path / "cache")
    (tmp_path / "full_disk.log").write_text(r.stdout)   # for a post-mortem
    errors = helpers.error_lines(r.stdout)
    assert r.returncode == 1, r.stdout[-3000:]
    assert len(errors) == 1 and "no space left on device" in errors[0].lower(), (
        [l for l in r.stdout.splitlines() if "rror" in l][:5])
    assert str(workdir) in errors[0] and "Traceback" not in r.stdout
    kept = helpers.all_hashes(workdir)
    assert kept, "no checkpoint fit: the trial needs a larger tmpfs"
    subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=True)
    r = helpers.run_train(workdir, cache_dir=tmp_path / "cache")
    assert r.returncode == 0, r.stdout[-3000:]
    helpers.assert_kept(workdir, kept)
    assert helpers.train_losses(workdir) == helpers.train_losses(tmp_path / "ref")
    print(f"full disk: kept {sorted(kept)}, resumed to {helpers.committed_steps(workdir)}")
  finally:
    subprocess.run(["umount", str(mnt)], check=False)
