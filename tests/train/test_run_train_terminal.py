"""run_train.py's terminal: --help / --print_config, a rerun of a finished run, the end of a run.

The rerun test trains 2 tiny steps in process; the whole-CLI test (clean lines, the end
summary, the sample, the rerun message as printed) is slow.
"""

import hashlib
import os
import subprocess
import sys

import pytest
import yaml

from hybridmoe_jax.loading import load_exported_params
from hybridmoe_jax.cli.terminal import end_lines
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests.conftest import ROOT, load_config

RUN = [sys.executable, str(ROOT / "run_train.py")]
TINY = {"steps": 2, "seq_len": 32, "batch_size": 2, "eval_batches": 1, "eval_every": 0,
        "heatmap_every": 1, "log_every": 1, "checkpoint_every": 0}


def _run(*args, timeout=300):
  return subprocess.run(RUN + list(args), capture_output=True, text=True, timeout=timeout,
                        cwd=ROOT, check=False)


def _snapshot(workdir):
  """{relative path: sha1} of every file in a workdir but the lock."""
  out = {}
  for dirpath, _, files in os.walk(workdir):
    for f in files:
      path = os.path.join(dirpath, f)
      rel = os.path.relpath(path, workdir)
      if "lock" not in rel:
        out[rel] = hashlib.sha1(open(path, "rb").read()).hexdigest()
  return out


def test_help_shows_config_and_print_config_lists_fields():
  p = _run("--help")     # (absl's --help exits with status 1)
  assert "--config: Run config file" in p.stdout and "--print_config" in p.stdout
  p = _run("--print_config", "--config.train.steps=7")
  assert p.returncode == 0, p.stderr
  assert "steps: 7" in p.stdout and "kda:" in p.stdout and "seq_len:" in p.stdout
  # Plain YAML (no !!python/tuple tags) that names the file and the overrides.
  lines = p.stdout.splitlines()
  assert lines[0] == f"# config file: {ROOT / 'configs' / 'tiny.py'}"
  assert lines[1] == "# overrides: --config.train.steps=7" and "!!" not in p.stdout
  loaded = yaml.safe_load(p.stdout)
  assert loaded["train"]["steps"] == 7 and loaded["curriculum"]["niah_depths"] == [0.1, 0.5,
                                                                                   0.9]


def test_end_lines_do_not_repeat_the_done_summary():
  """The closing lines name the outputs and the next commands; the losses, bits/byte and
  time are the loop's `done:` line's alone (the end of a run said them twice)."""
  lines = end_lines({"start_step": 0, "end_step": 300, "first_loss": 6.0, "last_loss": 1.0,
                     "eval": {"loss": 1.6, "bits_per_byte": 2.38}, "wall_s": 360.0},
                    "runs/default")
  text = "\n".join(lines)
  assert lines[0].startswith("outputs in runs/default/ (steps 0..300): checkpoints/")
  for repeated in ("loss", "bits/byte", "6m", "nats"):
    assert repeated not in text
  assert "--config.train.steps=600" in text


def test_rerun_of_a_finished_run_changes_nothing(tmp_path, caplog):
  cfg = load_config("tiny")
  cfg.train.update(TINY)
  workdir = str(tmp_path / "run")
  first = train_and_evaluate(run_config_from_dict(cfg), workdir)
  assert first["end_step"] == 2 and first["first_loss"] is not None
  before = _snapshot(workdir)
  assert "metrics.jsonl" in before and any(k.startswith("tensorboard") for k in before)
  caplog.set_level("INFO")
  again = train_and_evaluate(run_config_from_dict(cfg), workdir)
  assert again["already_finished"] and again["end_step"] == 2
  assert "already finished at step 2; raise --config.train.steps to continue" in caplog.text
  assert _snapshot(workdir) == before     # no record appended, no event file, no checkpoint
  # A finished run exports without training, and its logs stay as they were.
  export = str(tmp_path / "export")
  train_and_evaluate(run_config_from_dict(cfg), workdir, export_params_to=export)
  exported = load_exported_params(export)
  assert exported["params"] and exported["routing_biases"]
  assert _snapshot(workdir) == before


@pytest.mark.slow
def test_cli_prints_clean_lines_a_sample_and_an_end_summary(tmp_path):
  """~60 s: the whole CLI twice (train 3 steps + a sample; rerun)."""
  workdir = str(tmp_path / "run")
  flags = [f"--workdir={workdir}", "--config.train.steps=3", "--config.train.seq_len=32",
           "--config.train.batch_size=2", "--config.train.eval_batches=1",
           "--config.train.log_every=2", "--sample_tokens=12", "--sample_prompt=def "]
  p = _run(*flags)
  assert p.returncode == 0, p.stderr[-3000:]
  err = p.stderr.splitlines()
  # Clean lines: no absl prefix, no libtpu probe on this CPU machine; step 1 is logged.
  assert not [l for l in err if l[:1] in "IWEF" and l[1:5].isdigit()], err
  assert not [l for l in err if "libtpu" in l or "backend 'tpu'" in l or "TPU_" in l], err
  assert any(l.startswith("step 1/3 | loss ") for l in err), err
  assert any(l.startswith("done: step 3, loss ") and "bits/byte" in l for l in err), err
  out = p.stdout
  assert "sample (12 tokens, temperature 0.8):\ndef " in out
  # One summary: the loop's `done:` line; stdout says where the outputs are, not the numbers.
  assert sum(l.startswith("done: ") for l in err) == 1 and "bits/byte" not in out
  assert f"outputs in {workdir}/ (steps 0..3)" in out
  assert f"python run_eval.py --workdir={workdir}" in out
  before = _snapshot(workdir)
  p = _run(*flags)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "already finished at step 3; raise --config.train.steps to continue" in p.stderr
  assert "nan tok/s" not in p.stderr + p.stdout and "sample" not in p.stdout
  assert _snapshot(workdir) == before
