"""Issue 33: faults and bad inputs that ended in a traceback or the wrong words now end in one
line naming the path or the knob, and lose nothing.

In-process where the error is an exception `run_train.py` / `run_eval.py` print as one line
(`error: <message>`); the disk errors are injected where the write happens.
"""

import errno
import json
import os

import pytest
from orbax.checkpoint._src.handlers import json_checkpoint_handler

from hybridmoe_jax.evals import runner
from hybridmoe_jax.io import safetensors
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import params_export
from hybridmoe_jax.train import loop
from hybridmoe_jax.train import step as step_lib
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests._support import tiny_run_config
from tests.faults import helpers

FULL_AT = 6


def _fail_save_at(monkeypatch, step: int, code: int):
  """The save of `step` fails as tensorstore reports it: a ValueError naming the OS error
  only in its text (the real full-disk trial showed this form)."""
  real = json_checkpoint_handler.JsonCheckpointHandler._save_fn

  async def failing(self, x, directory):
    if isinstance(x, dict) and x.get("step") == step:
      raise ValueError(f'INTERNAL: Error writing local file "{directory}/metadata": '
                       f"[OS error {code}: {os.strerror(code)}]")
    return await real(self, x, directory)

  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", failing)


@pytest.mark.parametrize("code,words", [(errno.EFBIG, "file too large"),
                                        (errno.EDQUOT, "disk quota exceeded")])
def test_file_size_limit_and_quota_during_a_save_are_one_line(tmp_path, monkeypatch, code,
                                                              words):
  """EFBIG (ulimit -f) and EDQUOT were not recognised (only "No space left on device")."""
  config, workdir = tiny_run_config(trial=True), tmp_path / "run"
  _fail_save_at(monkeypatch, FULL_AT, code)
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    train_and_evaluate(run_config_from_dict(config), str(workdir), data=helpers.fake_data(config))
  message = str(e.value)
  assert "\n" not in message and words in message and str(workdir) in message, message
  assert f"checkpoint step {FULL_AT}" in message and "newest: step 4" in message
  assert helpers.committed_steps(workdir) == [2, 4]


def test_export_to_a_full_disk_leaves_nothing_and_the_rerun_exports(tmp_path, monkeypatch):
  """`--export_params_to` on a full disk: one line naming the export (not "the workdir ...
  rerun to resume"); no half export is left, so the rerun is not refused and exports."""
  config, workdir, export = tiny_run_config(trial=True), tmp_path / "run", tmp_path / "export"
  real_write = safetensors.SafetensorsWriter.write

  def full(self, *a, **k):
    raise OSError(errno.ENOSPC, "No space left on device", str(export) + ".partial/x")

  monkeypatch.setattr(safetensors.SafetensorsWriter, "write", full)
  with pytest.raises(params_export.ExportWriteError) as e:
    train_and_evaluate(run_config_from_dict(config), str(workdir), data=helpers.fake_data(config),
                       export_params_to=str(export))
  message = str(e.value)
  assert "\n" not in message and f"params export {export}" in message
  assert "no space left on device" in message
  assert not os.path.exists(export) and not os.path.exists(f"{export}.partial")
  kept = helpers.all_hashes(workdir)
  assert sorted(kept) == [2, 4, 6, 8]
  monkeypatch.setattr(safetensors.SafetensorsWriter, "write", real_write)
  os.makedirs(f"{export}.partial")         # as a SIGKILLed export would leave it
  s = train_and_evaluate(run_config_from_dict(config), str(workdir), data=helpers.fake_data(config),
                         export_params_to=str(export))
  assert s["start_step"] == s["end_step"] == 8
  assert os.path.isfile(export / params_export.PARAMS_FILE)
  assert not os.path.exists(f"{export}.partial")
  helpers.assert_kept(workdir, kept)


def test_out_of_memory_at_the_first_step_names_the_knobs(tmp_path, monkeypatch):
  def oom_step(*a, **k):
    def step(*_a, **_k):
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                         "17179869184 bytes.\n" + "  traceback line\n" * 50)
    return step

  monkeypatch.setattr(step_lib, "make_train_step", oom_step)
  config = tiny_run_config(trial=True)
  with pytest.raises(loop.OutOfMemory) as e:
    train_and_evaluate(run_config_from_dict(config), str(tmp_path / "run"),
                       data=helpers.fake_data(config))
  message = str(e.value)
  assert "\n" not in message and "out of memory" in message
  t = config.train
  for knob in (f"train.batch_size (now {t.batch_size})", f"train.seq_len (now {t.seq_len})",
               "compute.remat",
               "train.grad_accum"):
    assert knob in message, message


def test_empty_workdir_is_refused(tmp_path, monkeypatch):
  """`--workdir=` trained into the current directory."""
  monkeypatch.chdir(tmp_path)
  config = tiny_run_config(trial=True)
  with pytest.raises(loop.InputError, match="--workdir= is empty"):
    train_and_evaluate(run_config_from_dict(config), "", data=helpers.fake_data(config))
  assert os.listdir(tmp_path) == []


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
  path = tmp_path / "file"
  path.write_text("mine")
  config = tiny_run_config(trial=True)
  with pytest.raises(loop.InputError, match=f"--workdir={path} is a file"):
    train_and_evaluate(run_config_from_dict(config), str(path), data=helpers.fake_data(config))
  assert path.read_text() == "mine"


def test_eval_results_on_a_full_disk_name_the_file_and_leave_no_empty_json(tmp_path,
                                                                         monkeypatch):
  """run_eval --output_dir on a full disk left a 0-byte ppl.json and named no file."""
  out = tmp_path / "eval"
  out.mkdir()
  (out / "ppl.json").write_text('{"previous": 1}')
  real_dump = json.dump

  def full(obj, f, *a, **k):
    f.write("{")
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(json, "dump", full)
  with pytest.raises(OSError) as e:
    runner.write_result(str(out / "ppl.json"), {"result": 1.0})
  monkeypatch.setattr(json, "dump", real_dump)
  message = str(e.value)
  assert "\n" not in message and f"{out / 'ppl.json'}" in message
  assert "no space left on device" in message and "[Errno" not in message
  assert (out / "ppl.json").read_text() == '{"previous": 1}'    # the previous result kept
  assert os.listdir(out) == ["ppl.json"]                          # no temp file left
  runner.write_result(str(out / "mqar.json"), {"result": 2.0})
  assert json.loads((out / "mqar.json").read_text()) == {"result": 2.0}


@pytest.mark.slow
def test_convert_to_hf_into_a_full_disk_is_one_line_and_the_rerun_works(tmp_path):
  """`python -m hybridmoe_jax.convert --to_hf` into a full disk printed a 21-line traceback
  (and could leave a .partial that refused the rerun)."""
  from hybridmoe_jax.convert import convert  # pylint: disable=import-outside-toplevel
  from tests.convert.kimi_tiny import write_hf_dir  # pylint: disable=import-outside-toplevel
  hf = write_hf_dir(tmp_path / "hf")
  ours = str(tmp_path / "ours")
  convert.from_hf(hf, ours)
  out = str(tmp_path / "hf_out")
  cmd = ["-m", "hybridmoe_jax.convert", "--to_hf", out, "--from", ours]
  for fault in ("enospc", "efbig"):
    r = helpers.run_cli(cmd, fault=f"{fault}:{out}", timeout=300)
    assert r.returncode == 2, r.stdout[-3000:]
    errors = helpers.error_lines(r.stdout)
    assert len(errors) == 1 and "Traceback" not in r.stdout, r.stdout[-3000:]
    assert out in errors[0] and ("no space left" in errors[0] or "file too large" in errors[0])
    assert not os.path.exists(out) and not os.path.exists(out + ".partial")
  r = helpers.run_cli(cmd, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:]
  assert os.path.isfile(os.path.join(out, "config.json"))
