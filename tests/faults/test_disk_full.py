"""Trial 3: the disk fills up during a save (in-process, injected into orbax's writer).

ENOSPC is raised where orbax writes a step's files, in its background commit thread, as a
full disk would. The run must stop with one line naming the workdir and "no space", keep
every earlier checkpoint, leave no partial step where the next start would read it, and a
resume (with space again) must continue exactly.
"""

import errno

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train.loop import train_and_evaluate
from tests.conftest import one_device
from tests.faults import helpers

FULL_AT = 6  # the save of this step hits the full disk


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("ref")
  config = helpers.tiny_config()
  with one_device():  # module fixtures run before conftest's one-device fixture
    summary = train_and_evaluate(config, str(workdir), data=helpers.fake_data(config))
  return dict(config=config, summary=summary, losses=helpers.train_losses(workdir))


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
    train_and_evaluate(config, str(workdir), data=helpers.fake_data(config))
  message = str(e.value)
  assert "\n" not in message and "no space" in message.lower() and str(workdir) in message
  assert helpers.committed_steps(workdir) == [2, 4]
  kept = helpers.all_hashes(workdir)
  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", real_save)

  with helpers.LogLines() as log:
    s = train_and_evaluate(config, str(workdir), data=helpers.fake_data(config))
  assert s["start_step"] == 4 and s["end_step"] == 8
  helpers.assert_kept(workdir, kept)
  # The unfinished step 6 was set aside (not read, not deleted), with one warning.
  partial = [l for l in log.messages() if "partial checkpoint" in l]
  assert len(partial) <= 1
  assert not [n for n in (workdir / "checkpoints").iterdir() if not n.name.isdigit()]
  assert helpers.train_losses(workdir) == reference["losses"]
  for a, b in zip(jax.tree.leaves(reference["summary"]["state"]), jax.tree.leaves(s["state"])):
    np.testing.assert_array_equal(a, b)
