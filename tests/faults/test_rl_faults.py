"""Issue 33, the RL run: a workdir locked by another run or being a regular file, `--init_from`
a run with another vocabulary, a truncated newest `rl_state/<step>.pkl`, and the rotation
of `rl_state/` with the checkpoints. Each ends in one line (or one warning) naming the path,
and nothing saved is lost."""

import os

import pytest

from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.rl import run_state, trainer
from hybridmoe_jax.train import workdir_config
from hybridmoe_jax.cli import workdir_lock
from hybridmoe_jax.train import loop
from tests.faults import helpers
from tests.rl.test_trainer import tiny_rl_config


def test_rl_workdir_locked_by_another_run_is_one_line(tmp_path):
  with workdir_lock.WorkdirLock(str(tmp_path)):
    with pytest.raises(loop.InputError, match=f"workdir {tmp_path} is in use by another run "
                       f"\\(pid {os.getpid()}"):
      trainer.train_rl(run_config_from_dict(tiny_rl_config()), str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == [workdir_lock.LOCK_FILE + ".guard"]


def test_rl_workdir_that_is_a_file_or_empty_is_one_line(tmp_path, monkeypatch):
  path = tmp_path / "file"
  path.write_text("mine")
  with pytest.raises(loop.InputError, match=f"--workdir={path} is a file"):
    trainer.train_rl(run_config_from_dict(tiny_rl_config()), str(path))
  assert path.read_text() == "mine"
  monkeypatch.chdir(tmp_path)
  with pytest.raises(loop.InputError, match="--workdir= is empty"):
    trainer.train_rl(run_config_from_dict(tiny_rl_config()), "")
  assert os.listdir(tmp_path) == ["file"]


def test_rl_init_from_a_run_with_another_vocabulary_names_it(tmp_path):
  """It blamed "the workdir" (the RL run's own) for the source's different model config."""
  src = tmp_path / "pretrained"
  src.mkdir()
  (src / "checkpoints").mkdir()
  other = tiny_rl_config()
  other.model.vocab_size = 259                       # the byte tokenizer's run
  from hybridmoe_jax.config.run import run_config_from_dict  # pylint: disable=g-import-not-at-top
  import dataclasses  # pylint: disable=g-import-not-at-top
  workdir_config.write_workdir_config(str(src), dataclasses.asdict(run_config_from_dict(other).model))
  c = tiny_rl_config()
  c.rl.init_from = str(src)
  with pytest.raises(ConfigError) as e:
    trainer.train_rl(run_config_from_dict(c), str(tmp_path / "rl"))
  message = str(e.value)
  assert "\n" not in message and "vocabulary of 259 ids" in message and "266" in message
  assert str(src) in message and "holds a run of an incompatible" not in message


@pytest.mark.slow
def test_truncated_newest_rl_state_falls_back_and_old_ones_rotate(tmp_path):
  """A truncated newest rl_state/<step>.pkl stopped the resume with an unpickling traceback;
  old rl_state/*.pkl were never deleted when their checkpoints rotated away."""
  workdir = tmp_path / "rl"
  cfg = tiny_rl_config(iterations=3, save_every=1, eval_every=0)
  cfg.train.keep_checkpoints = 2
  trainer.train_rl(run_config_from_dict(cfg), str(workdir))
  steps = helpers.committed_steps(workdir)
  assert steps == [4, 5]                              # 2 SFT steps + iterations 2, 3
  assert sorted(os.listdir(workdir / run_state.STATE_DIR)) == ["4.pkl", "5.pkl"]
  kept = helpers.step_hashes(workdir, 4)
  newest = workdir / run_state.STATE_DIR / "5.pkl"
  data = newest.read_bytes()
  newest.write_bytes(data[:len(data) // 2])
  with helpers.LogLines() as log:
    s = trainer.train_rl(run_config_from_dict(cfg), str(workdir))  # resumes at step 4, redoes iteration 3
  warnings = [m for m in log.messages() if "is corrupt or partial" in m]
  assert len(warnings) == 1 and "5.pkl is unreadable" in warnings[0], log.messages()
  assert s["iteration"] == 3
  assert helpers.step_hashes(workdir, 4) == kept
  assert helpers.committed_steps(workdir) == [4, 5]
  assert os.listdir(workdir / "checkpoints_corrupt")  # step 5 set aside, not deleted
