"""run_train.py as a user runs it: bad input stops with one message; dry run; resume; signals.

The fast tests stop before training (one interpreter start per kind of error; the other bad
values of a kind are checked in process). The slow ones train the tiny model: the embedded
default run, SIGKILL-and-resume exactness, SIGINT, QB vs none.
"""

import functools
import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from hybridmoe_jax.config import flags as cli_flags
from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.loading import load_exported_params
from hybridmoe_jax.train.loop import InputError, train_and_evaluate
from tests.conftest import ROOT, load_config

RUN = [sys.executable, str(ROOT / "run_train.py")]


def _run(*args, timeout=120, **kw):
  return subprocess.run(RUN + list(args), capture_output=True, text=True, timeout=timeout,
                        cwd=ROOT, **kw)


def _one_error(p, *needles):
  assert p.returncode != 0, p.stdout + p.stderr
  assert "Traceback" not in p.stderr, p.stderr
  err = [l for l in p.stderr.splitlines() if l.startswith(("error:", "FATAL"))]
  assert len(err) == 1, p.stderr
  for n in needles:
    assert n in err[0], err[0]
  return err[0]


# Each kind of flag error as a user meets it (one interpreter start each, ~4 CPU-s): a
# misspelt field, a bad value type, a missing file, a moved field (cli_flags, while absl
# parses), a bad value (run_config_from_dict's ConfigError, in main) and a model that does
# not fit the data. The other values of each kind take the same path: their messages are
# checked in process below.
@pytest.mark.parametrize("flag,needles", [
    ("--config.train.stepz=3", ["--config.train.stepz", "steps"]),
    ("--config.train.steps=abc", ["--config.train.steps=abc"]),
    ("--config.train.schedule=linear", ["train.schedule", "cosine"]),
    ("--config=configs/nonexistent.py", ["nonexistent.py"]),
    ("--config.model.vocab_size=100", ["vocab"]),   # the tokenizer check, when data is built
    ("--config.model.dtype=bfloat16", ["model.dtype", "moved to `compute.dtype`"]),
])
def test_bad_flags_stop_with_one_message(tmp_path, flag, needles):
  _one_error(_run(flag, f"--workdir={tmp_path}"), *needles)
  assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("key,value,needles", [
    ("train.grad_accum", 3, ["train.grad_accum", "divisor"]),
    ("model.moe.balancing", "off", ["model.moe.balancing", "qb"]),
    ("compute.dtype", "float16", ["compute.dtype", "bfloat16"]),
    ("data.heldout_fraction", 0.9, ["data.heldout_fraction", "(0, 0.5]"]),
])
def test_bad_config_values_are_one_line(key, value, needles):
  """run_train.py's bad-value path in process: the override on the default config, then the
  ConfigError that main prints as `error: <message>`."""
  config = load_config("tiny")
  config.update_from_flattened_dict({key: value})
  with pytest.raises(ConfigError) as e:
    run_config_from_dict(config)
  msg = str(e.value)
  assert "\n" not in msg and all(n in msg for n in needles), msg


@pytest.mark.parametrize("flag,needles", [
    ("--config.train.remat=full", ["train.remat", "moved to `compute.remat`"]),
    ("--config.model.kda.chunk_size=32", ["model.kda.chunk_size", "compute.kda_chunk_size"]),
])
def test_moved_fields_are_one_line(flag, needles):
  """cli_flags' message for a moved field: the field is gone from the config (so absl's
  parse raises, as for --config.model.dtype above) and the flag's name decides the message."""
  *section, field = flag.split("=")[0][len("--config."):].split(".")
  assert field not in functools.reduce(getattr, section, load_config("tiny"))
  msg = cli_flags.config_flag_error(AttributeError("no field"), ["run_train.py", flag])
  assert msg.startswith("error: bad --config flag") and "\n" not in msg
  assert all(n in msg for n in needles), msg


@pytest.mark.parametrize("cmd", [RUN, [sys.executable, "-m", "hybridmoe_jax.tools.describe"]])
def test_misspelt_override_of_a_named_config_file_is_one_line(tmp_path, cmd):
  """With --config given, ml_collections reads overrides inside app.run (a raw traceback
  before cli_flags.parse_flags)."""
  p = subprocess.run(cmd + ["--config=configs/tiny.py", "--config.train.stepz=5",
                            f"--workdir={tmp_path}"][:3 if "describe" in cmd[-1] else 4],
                     capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert "no config field 'stepz'" in _one_error(p, "--config.train.stepz=5", '"steps"')


@pytest.mark.parametrize("preset,flag", [("rl_tiny", "export_params_to"),
                                         ("tiny", "init_from")])
def test_flags_of_the_other_kind_of_run_stop_before_anything_runs(tmp_path, monkeypatch,
                                                                    preset, flag):
  """--export_params_to with an RL config (the RL trainer writes no export: it was ignored
  silently) and --init_from with a pre-training one: one `error:` line naming the flag,
  nothing written in the workdir. In process: tools.train.main is run_train.py's program."""
  import types
  from hybridmoe_jax.rl import trainer as rl_trainer
  from hybridmoe_jax.tools import train as train_tool
  from hybridmoe_jax.train import loop

  for module, name in ((rl_trainer, "train_rl"), (loop, "train_and_evaluate")):
    monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the run started"))
  kw = dict(workdir=str(tmp_path / "w"), print_config=False, dry_run=False,
            export_params_to=None, init_from=None, sample_tokens=0, sample_prompt="",
            absl_logs=True, distributed={"enable": False})
  kw[flag] = str(tmp_path / "x")
  with pytest.raises(SystemExit) as e:
    train_tool.main(types.SimpleNamespace(value=load_config(preset)), config_file=preset,
                    overrides=[], **kw)
  assert str(e.value).startswith(f"error: --{flag}") and "\n" not in str(e.value)
  assert not (tmp_path / "w").exists() and not (tmp_path / "x").exists()


def test_describe_runs_from_any_directory_and_a_missing_config_is_one_line(tmp_path):
  """tools.describe's default config is found outside the repo's root (was: a relative
  configs/tiny.py, a traceback elsewhere), and a --config file that does not exist is one
  `error:` line (was: a traceback)."""
  cmd = [sys.executable, "-m", "hybridmoe_jax.tools.describe"]
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
  assert p.returncode == 0 and p.stdout.startswith("layers (4)"), p.stderr
  _one_error(subprocess.run(cmd + ["--config=nope.py"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, env=env), "nope.py")


def test_missing_and_empty_data(tmp_path):
  _one_error(_run("--config.data.source=text", f"--config.data.paths={tmp_path}/nope.txt",
                  f"--workdir={tmp_path}/w1"), "nope.txt")
  # An empty file takes the same path through main (an InputError printed as the one
  # `error:` line above): checked in process, without a second interpreter start.
  (tmp_path / "empty.txt").write_text("")
  config = load_config("tiny")
  config.data.update(source="text", paths=(str(tmp_path / "empty.txt"),))
  with pytest.raises(InputError, match="empty") as e:
    train_and_evaluate(run_config_from_dict(config), str(tmp_path / "w2"))
  assert "\n" not in str(e.value)


# The refusal itself is tests/train/test_loop.py::test_incompatible_workdir_is_refused (in
# process); main prints its ConfigError as one `error:` line as for
# test_bad_flags_stop_with_one_message[--config.train.schedule=linear].
@pytest.mark.slow
def test_incompatible_workdir(tmp_path):
  (tmp_path / "model_config.json").write_text(json.dumps({"d_model": 32}))
  _one_error(_run(f"--workdir={tmp_path}"), "incompatible", "d_model")


def test_dry_run_tiny():
  p = _run("--dry_run")
  assert p.returncode == 0, p.stderr
  assert "parameters: total" in p.stdout and "per device" in p.stdout


def test_dry_run_bad_topology_is_one_line():
  """A TPU topology name that is not one (checked with the config, before any compile or
  libtpu load) stops with one line naming the field and the accepted forms."""
  _one_error(_run("--dry_run", "--config.hardware.topology=v5p-7"), "hardware.topology",
             "v5p:2x2x1", "v5p-256")


# The flagship's memory model runs in-process in tests/train/test_curriculum.py
# (curriculum_1m on 16 H200) and its parameter counts in tests/model/test_count.py; this is
# the CLI on a 1024-device mesh (~20 CPU-s).
@pytest.mark.slow
def test_dry_run_k3_on_1024_devices():
  p = _run("--config=configs/kimi_k3.py", "--dry_run", "--config.mesh.fsdp=64",
           "--config.mesh.expert=16")
  assert p.returncode == 0, p.stderr
  assert "1024 device(s)" in p.stdout and "B)" in p.stdout, p.stdout


# ------------------------------------------------------------------------------------ slow
_SMALL = ["--config.train.steps=24", "--config.train.seq_len=64", "--config.train.batch_size=4",
          "--config.train.log_every=1", "--config.train.eval_every=0",
          "--config.train.checkpoint_every=4", "--config.train.heatmap_every=0",
          "--config.train.eval_batches=1"]


def _losses(workdir):
  out = {}
  for line in open(os.path.join(workdir, "metrics.jsonl")):
    r = json.loads(line)
    if r.get("split") == "train":
      out[r["step"]] = r["loss"]
  return out


def _wait_for_step(workdir, step, proc, timeout=300):
  t0 = time.time()
  while time.time() - t0 < timeout:
    if proc.poll() is not None:
      raise AssertionError(f"run ended early: {proc.stderr.read()[-2000:]}")
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path) and max(_losses(workdir), default=0) >= step:
      return
    time.sleep(0.05)
  raise AssertionError("timed out waiting for training progress")


@pytest.mark.slow
def test_sigkill_resume_is_exact(tmp_path):
  ref, run = tmp_path / "ref", tmp_path / "run"
  p = _run(*_SMALL, f"--workdir={ref}", f"--export_params_to={tmp_path}/ref_params",
           timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  kill_at = random.Random().randint(5, 20)
  proc = subprocess.Popen(RUN + _SMALL + [f"--workdir={run}"], cwd=ROOT, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  _wait_for_step(run, kill_at, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  p = _run(*_SMALL, f"--workdir={run}", f"--export_params_to={tmp_path}/run_params",
           timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "restored checkpoint" in p.stderr
  assert _losses(run) == _losses(ref), f"killed at step >= {kill_at}"
  a = load_exported_params(tmp_path / "ref_params")
  b = load_exported_params(tmp_path / "run_params")
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_sigint_checkpoints_and_exits(tmp_path):
  proc = subprocess.Popen(RUN + _SMALL + ["--config.train.checkpoint_every=1000",
                                          f"--workdir={tmp_path}"],
                          cwd=ROOT, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  _wait_for_step(str(tmp_path), 3, proc)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signal.SIGINT, err[-3000:]  # scripts tell it from a finish
  assert "received SIGINT" in err
  steps = [int(s) for s in os.listdir(tmp_path / "checkpoints")]
  assert len(steps) == 1 and 3 <= steps[0] < 24


@pytest.mark.slow
def test_default_run_learns(tmp_path):
  """The embedded default: `python run_train.py` (here with a fresh workdir)."""
  p = _run(f"--workdir={tmp_path}", timeout=1200)
  assert p.returncode == 0, p.stderr[-3000:]
  losses = _losses(tmp_path)
  first, last = losses[min(losses)], losses[max(losses)]
  assert last < 0.5 * first, (first, last)
  evals = [json.loads(l) for l in open(tmp_path / "metrics.jsonl") if '"eval"' in l]
  assert evals[-1]["bits_per_byte"] < 3.5
  assert (tmp_path / "expert_load.png").exists()
