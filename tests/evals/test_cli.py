"""run_eval.py bad input: one clear line, no traceback; params-export loading round trip."""

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.tools.evaluate import main
from hybridmoe_jax.loading import load_model
from hybridmoe_jax.evals.runner import default_output_dir
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.train.workdir_config import CONFIG_FILE
from hybridmoe_jax.train.params_export import export_params
from tests.conftest import ROOT
from tests._support import TWO_LAYERS, tiny_model, tiny_model_config


@pytest.fixture(scope="module")
def export(tmp_path_factory):
  model = tiny_model(layer_kinds=TWO_LAYERS)
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
  want = nnx.to_pure_dict(nnx.state(tiny_model(layer_kinds=TWO_LAYERS)))
  got = nnx.to_pure_dict(nnx.state(model))
  jax.tree.map(np.testing.assert_array_equal, want, got)


def test_config_mismatch_in_process(export, tmp_path):
  with pytest.raises(ConfigError, match="model.d_model: 64 stored vs 96 in --config"):
    load_model(params=export, expected=tiny_model_config(d_model=96))
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
  refuses, and a ValueError from tools.evaluate.main (printed as one `error:` line). The other
  ValueErrors of main take the same path: their messages are checked in process below."""
  assert "task" in _run(f"--params={export}", "--task=bleu")
  assert "exactly one of --workdir or --params" in _run("--task=ppl")
  err = _run(f"--params={export}", "--config=configs/small.py", "--task=ppl")
  assert err.startswith("error: --config does not match") and "model.d_model" in err


def test_bad_input_in_process(export, tmp_path):
  """tools.evaluate.main's ValueErrors (run_eval.py prints `error: <message>`), before any task."""
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


def test_params_results_go_beside_the_export(export, tmp_path):
  """--params without --output_dir writes <params>_eval, never into the export itself."""
  before = sorted(os.listdir(export))
  lines = []
  main(task="generate", workdir=None, params=export, output_dir=None, config=None,
       option_values={"prompt": "ab", "max_new_tokens": 2}, echo=lines.append)
  assert sorted(os.listdir(export)) == before
  out = export.rstrip("/") + "_eval"
  assert lines[-1] == f"results in {out}" and os.path.isfile(os.path.join(out, "generate.json"))
  assert default_output_dir("runs/x", None) == os.path.join("runs/x", "eval")
  assert default_output_dir(None, "exports/p/") == "exports/p_eval"


def _help_examples(text: str) -> list[str]:
  return [l.strip() for l in text.splitlines() if l.strip().startswith("python ")]


@pytest.mark.parametrize("script", ["run_eval.py", "run_train.py"])
def test_help_examples_are_copyable(script, tmp_path):
  """Every example of --help is one shell line whose flags exist; the image one runs."""
  r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True,
                     text=True, timeout=120)
  lines = _help_examples(r.stdout)
  assert len(lines) >= 6, r.stdout[:2000]
  flags_known = set(re.findall(r"--(?:\[no\])?(\w+)", r.stdout))
  for line in lines:
    argv = shlex.split(line.split("  #")[0])    # one line: a whole command (no stray quotes)
    assert argv[0] == "python", line
    if argv[1] != script:
      continue
    for arg in argv[2:]:
      if arg.startswith("--") and not arg.startswith("--config."):
        assert arg[2:].split("=")[0].removeprefix("no") in flags_known, (arg, line)
  maker = next((l for l in lines if l.startswith("python -c")), None)
  if script == "run_eval.py":   # the scene the last example reads: made by the line before it
    # This interpreter for the example's `python` (the one a user's activated venv gives).
    subprocess.run([sys.executable] + shlex.split(maker)[1:], cwd=tmp_path, check=True,
                   timeout=120)
    from hybridmoe_jax.data.images import read_image  # pylint: disable=import-outside-toplevel
    assert read_image(str(tmp_path / "scene.ppm")).shape == (32, 32, 3)
    assert "$'Q: colour at top left?\\n<image>\\nA:'" in r.stdout


def test_generate_reports_compile_and_run_apart(export, tmp_path):
  lines = []
  r = main(task="generate", workdir=None, params=export, output_dir=str(tmp_path),
           config=None, option_values={"prompt": "abc", "max_new_tokens": 3, "seed": 5,
                                       "max_len": 72}, echo=lines.append)["generate"]
  # A cache size no other test uses: this call compiles (prefill + decode loop), then runs
  # (a new max_new_tokens or seed alone compiles nothing: Engine.generate's buckets).
  assert r["compile_s"] > 0 and r["run_s"] >= 0
  assert abs(r["compile_s"] + r["run_s"] - r["seconds"]) < 1e-6
  assert any("compile " in l and "+ run " in l for l in lines), lines
  again = main(task="generate", workdir=None, params=export, output_dir=str(tmp_path),
               config=None, option_values={"prompt": "abc", "max_new_tokens": 3, "seed": 5,
                                           "max_len": 72}, echo=lambda _: None)["generate"]
  assert again["compile_s"] < r["compile_s"] and again["text"] == r["text"]
