"""Evals load a run through the training reader (`Checkpointer.restore_latest`), read-only:
a corrupt newest checkpoint is skipped and left in place by the eval, quarantined by the
resumed training; a model_config.json / meta written by older code still loads."""

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.loading import load_model
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import workdir_config
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests.conftest import load_config, one_device
from tests._support import set_tiny_model


def _config(steps):
  config = load_config("tiny")
  # The 2-layer MLA model of the train tests: what is checked here (the reader, skipping,
  # legacy configs) does not depend on the mixers, and each run compiles its own steps.
  set_tiny_model(config)
  config.model.moe.latent_dim = 8   # below d_model 16
  config.train.update(dict(steps=steps, batch_size=2, seq_len=32, warmup=1, log_every=1,
                           eval_every=0, eval_batches=1, checkpoint_every=1, keep_checkpoints=5,
                           heatmap_every=0, async_checkpoints=False))
  return config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A real (shrunk) tiny-model run with checkpoints at steps 1 and 2; its final train state."""
  workdir = tmp_path_factory.mktemp("run") / "w"
  with one_device():
    state = train_and_evaluate(run_config_from_dict(_config(2)), str(workdir))["state"]
  return workdir, state


def _files(root):
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, fs in os.walk(root) for f in fs + ["."])


def _legacy(d):
  """As older code wrote a model config: runtime fields inside, no `vision` section."""
  d = dict(d, dtype="bfloat16", kda=dict(d["kda"], impl="recurrent", chunk_size=32),
           moe=dict(d["moe"], capacity_factor=1.5))
  del d["vision"]
  return d


def test_eval_restores_exactly_what_training_saved(run):
  workdir, state = run
  model, info = load_model(workdir=str(workdir))
  assert info["step"] == 2 and info["source"] == "workdir" and info["data_config"]
  assert info["skipped"] == []
  _, params, biases, _ = nnx.split(model, nnx.Param, RoutingBias, ...)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(params),
               nnx.to_pure_dict(state.params))
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(biases),
               nnx.to_pure_dict(state.biases))


def test_one_reader_eval_skips_in_place_training_quarantines_legacy_config_loads(
    run, tmp_path, monkeypatch, caplog):
  workdir = tmp_path / "w"
  shutil.copytree(run[0], workdir)
  # Written by older code: runtime fields in the model config, `vision` not yet there.
  path = workdir / workdir_config.CONFIG_FILE
  path.write_text(json.dumps(_legacy(json.loads(path.read_text()))))
  for meta_file in glob.glob(str(workdir / "checkpoints" / "*" / "meta" / "metadata")):
    meta = json.load(open(meta_file))
    meta["model_config"] = _legacy(meta["model_config"])
    json.dump(meta, open(meta_file, "w"))
  for f in glob.glob(str(workdir / "checkpoints" / "2" / "state" / "**" / "d" / "*"),
                     recursive=True):
    os.remove(f)                                           # the newest checkpoint is corrupt
  calls = []
  restore = ckpt_lib.Checkpointer.restore_latest

  def spy(self, target, model_dict, check=None):
    out = restore(self, target, model_dict, check=check)
    calls.append((self.read_only, out.meta["step"], [s for s, _ in self.skipped]))
    return out

  monkeypatch.setattr(ckpt_lib.Checkpointer, "restore_latest", spy)
  before = _files(workdir)
  model, info = load_model(workdir=str(workdir))
  assert info["step"] == 1 and not model.cfg.vision.enabled     # the missing field's default
  assert [s["step"] for s in info["skipped"]] == [2]           # recorded with the results
  assert "checkpoint step 2 is corrupt or partial" in caplog.text
  assert _files(workdir) == before                         # the eval moved nothing
  s = train_and_evaluate(run_config_from_dict(_config(3)), str(workdir))
  assert s["start_step"] == 1 and s["end_step"] == 3
  assert [c.split("-")[0] for c in os.listdir(workdir / "checkpoints_corrupt")] == ["2"]
  # Both went through the same reader: the eval read-only, the training run writable.
  assert calls == [(True, 1, [2]), (False, 1, [2])]
