"""run_eval.py --task=all on the newest checkpoint of a real (3-step) tiny training run."""

import json
import os
import subprocess
import sys

import pytest

from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests.conftest import ROOT, load_config

FAST_FLAGS = ["--ppl_max_len=128", "--ppl_max_docs=1", "--niah_lengths=96,112",
              "--niah_depths=0,1", "--niah_samples=1", "--niah_digits=2",
              "--mqar_lengths=64,128", "--mqar_pairs=4", "--mqar_samples=1",
              "--max_new_tokens=4", "--max_len=128", "--prefill_chunk=32", "--kv_block=32"]


@pytest.mark.slow
def test_run_eval_all_on_trained_checkpoint(tmp_path):
  config = load_config("tiny")
  config.train.update(steps=3, batch_size=2, seq_len=64, warmup=1, eval_batches=1,
                      heatmap_every=0, log_every=1, async_checkpoints=False)
  workdir = tmp_path / "run"
  train_and_evaluate(run_config_from_dict(config), str(workdir))
  out = tmp_path / "eval"
  r = subprocess.run([sys.executable, "run_eval.py", f"--workdir={workdir}", "--task=all",
                      f"--output_dir={out}", *FAST_FLAGS], cwd=ROOT, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "model: step 3 of" in r.stdout and "== mqar" in r.stdout
  results = json.load(open(out / "results.json"))
  assert results["model"]["step"] == 3
  assert set(results["results"]) == {"ppl", "niah", "mqar", "generate"}
  assert os.path.exists(out / "niah_heatmap.png")
  # The run's stored config no longer matches its checkpoints: a one-line error.
  cfg_file = workdir / "model_config.json"
  cfg = json.load(open(cfg_file))
  cfg["num_layers"], cfg["layer_kinds"] = 5, cfg["layer_kinds"] + ["kda"]
  json.dump(cfg, open(cfg_file, "w"))
  r = subprocess.run([sys.executable, "run_eval.py", f"--workdir={workdir}", "--task=ppl"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode != 0 and "Traceback" not in r.stderr
  assert "incompatible model config" in r.stderr and "num_layers" in r.stderr
