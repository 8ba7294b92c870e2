"""run_eval.py bad input: one clear line, no traceback; params-export loading round trip."""

import dataclasses
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.evals.cli import main
from hybridmoe_jax.evals.loading import load_model
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.train.checkpoint import CONFIG_FILE, export_params
from tests.conftest import ROOT
from tests.infer.helpers import tiny_cfg, two_layer_model


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  model = two_layer_model()
  _, params, biases, _ = nnx.split(model, nnx.Param, RoutingBias, ...)
  path = tmp_path_factory.mktemp("export") / "params"
  return export_params(str(path), params, biases, dataclasses.asdict(model.cfg))


def _run(*args):
  r = subprocess.run([sys.executable, "run_eval.py", *args], cwd=ROOT, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
  return r.stderr


def test_export_round_trip(export):
  model, info = load_model(params=export)
  assert info == {"source": "params", "path": export}
  want = nnx.to_pure_dict(nnx.state(two_layer_model()))
  got = nnx.to_pure_dict(nnx.state(model))
  jax.tree.map(np.testing.assert_array_equal, want, got)


def test_config_mismatch_in_process(export, tmp_path):
  with pytest.raises(ConfigError, match="model.d_model: 64 stored vs 96 in --config"):
    load_model(params=export, expected=tiny_cfg(d_model=96))
  bad = tmp_path / "bad"
  shutil.copytree(export, bad)
  cfg = json.load(open(bad / CONFIG_FILE))
  cfg["vocab_size"] = 300
  json.dump(cfg, open(bad / CONFIG_FILE, "w"))
  with pytest.raises(ValueError, match="do not match .*embed"):
    load_model(params=str(bad))
  with pytest.raises(ValueError, match="exactly one"):
    load_model()
  with pytest.raises(ValueError, match="model_config.json"):
    load_model(workdir=str(tmp_path))


def test_cli_bad_input(export):
  """run_eval.py as a user runs it: a bad flag value (absl), a flag combination run_eval.py
  refuses, and a ValueError from evals.cli.main (printed as one `error:` line). The other
  ValueErrors of main take the same path: their messages are checked in process below."""
  assert "task" in _run(f"--params={export}", "--task=bleu")
  assert "exactly one of --workdir or --params" in _run("--task=ppl")
  err = _run(f"--params={export}", "--config=configs/small.py", "--task=ppl")
  assert err.startswith("error: --config does not match") and "model.d_model" in err


def test_bad_input_in_process(export, tmp_path):
  """evals.cli.main's ValueErrors (run_eval.py prints `error: <message>`), before any task."""
  def error(**kw):
    args = dict(task="generate", workdir=None, params=export, output_dir=str(tmp_path),
                config=None, option_values={})
    with pytest.raises(ValueError) as e:
      main(**{**args, **kw}, echo=lambda _: None)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)

  assert error(option_values={"prompt": ""}).startswith("--prompt is empty")
  err = error(option_values={"max_len": 16, "prompt": "x" * 40})
  assert err.startswith("prompt of 41 tokens does not fit") and "max_len=16" in err
  assert error(task="ppl", workdir=str(tmp_path), params=None).startswith("--workdir")


def test_eval_log_names_the_implementations(export, tmp_path):
  lines = []
  main(task="generate", workdir=None, params=export, output_dir=str(tmp_path), config=None,
       option_values={"prompt": "ab", "max_new_tokens": 2}, echo=lines.append)
  impl = [l for l in lines if l.startswith("implementation: ")]
  assert len(impl) == 3, lines   # kda, mla, moe: once each
  assert "(kda): chunked" in impl[0] and "(mla):" in impl[1] and "(moe):" in impl[2]
