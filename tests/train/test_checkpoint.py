"""The one checkpoint reader (`Checkpointer.restore_latest`): training quarantines a bad
checkpoint, a read-only reader (evals) skips it and leaves it in place; model-config checks
and the legacy migration shared with the params-export reader."""

import dataclasses
import glob
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ConfigError, ModelConfig
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import workdir_config
from hybridmoe_jax import loading
from hybridmoe_jax.train import params_export

_MODEL = dataclasses.asdict(ModelConfig())


def _state(step):
  return {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * step,
          "b": jnp.full((5,), step, jnp.int32)}


_ABSTRACT = jax.eval_shape(lambda: _state(1))


def _write(workdir, steps=(1, 2), model=None):
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=5, async_save=False)
  meta = {"model_config": model or _MODEL, "config": "{}",
          "signature": ckpt_lib.structure_signature(_ABSTRACT)}
  for s in steps:
    ckpt.save(s, _state(s), {"position": s}, meta)
  ckpt.close()


def _corrupt_arrays(workdir, step):
  files = glob.glob(str(workdir / "checkpoints" / str(step) / "state" / "**" / "d" / "*"),
                    recursive=True)
  assert files
  for f in files:
    os.remove(f)


def _tree(root):
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, fs in os.walk(root) for f in fs + ["."])


def _restore(workdir, read_only):
  ckpt = ckpt_lib.Checkpointer(str(workdir), keep=5, read_only=read_only)
  try:
    return ckpt.restore_latest(_ABSTRACT, _MODEL), ckpt
  finally:
    ckpt.close()


def test_round_trip_and_data_state(tmp_path):
  _write(tmp_path)
  for read_only in (False, True):
    r, ckpt = _restore(tmp_path, read_only)
    assert r.meta["step"] == 2 and r.data_state == {"position": 2} and not ckpt.skipped
    jax.tree.map(np.testing.assert_array_equal, r.state, _state(2))


def test_corrupt_newest_is_skipped_in_place_by_a_reader_and_moved_by_training(tmp_path,
                                                                               caplog):
  _write(tmp_path)
  _corrupt_arrays(tmp_path, 2)
  os.makedirs(tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1")   # a save in progress
  before = _tree(tmp_path)
  with caplog.at_level(logging.WARNING):
    r, ckpt = _restore(tmp_path, read_only=True)
  assert r.meta["step"] == 1 and [s for s, _ in ckpt.skipped] == [2]
  jax.tree.map(np.testing.assert_array_equal, r.state, _state(1))
  assert "checkpoint step 2 is corrupt or partial" in caplog.text and "left in place" in caplog.text
  assert _tree(tmp_path) == before                          # nothing moved, created or deleted
  with pytest.raises(RuntimeError, match="read-only"):
    ckpt.save(5, _state(5), {}, {})

  caplog.clear()
  with caplog.at_level(logging.WARNING):
    r, ckpt = _restore(tmp_path, read_only=False)
  assert r.meta["step"] == 1 and [s for s, _ in ckpt.skipped] == [2]
  assert "checkpoint step 2 is corrupt or partial" in caplog.text and "moved to" in caplog.text
  corrupt = os.listdir(tmp_path / "checkpoints_corrupt")
  assert any(c.startswith("2-") for c in corrupt) and any(c.startswith("3.") for c in corrupt)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]


def test_fingerprint_and_unreadable_meta_are_skipped_with_their_reason(tmp_path):
  _write(tmp_path, steps=(1, 2, 3))
  with open(tmp_path / "checkpoints" / "3" / "meta" / "metadata", "w") as f:
    f.write("{not json")
  meta_file = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["fingerprint"][0] += 1.0
  meta_file.write_text(json.dumps(meta))
  for read_only in (True, False):
    r, ckpt = _restore(tmp_path, read_only)
    assert r.meta["step"] == 1
    why = dict(ckpt.skipped)
    assert "unreadable metadata" in why[3] and "fingerprint" in why[2]


def test_no_readable_checkpoint_and_missing_directory(tmp_path):
  _write(tmp_path, steps=(1,))
  _corrupt_arrays(tmp_path, 1)
  r, ckpt = _restore(tmp_path, read_only=True)
  assert r is None and [s for s, _ in ckpt.skipped] == [1]
  with pytest.raises(ValueError, match="no checkpoints/ directory"):
    ckpt_lib.Checkpointer(str(tmp_path / "nothing"), read_only=True)
  assert not os.path.exists(tmp_path / "nothing")


def test_other_model_or_layout_is_refused_the_same_way_by_both(tmp_path):
  _write(tmp_path)
  other = dataclasses.asdict(ModelConfig(d_model=32, moe=dataclasses.replace(
      ModelConfig().moe, balancing="sign")))
  for read_only in (True, False):
    ckpt = ckpt_lib.Checkpointer(str(tmp_path), keep=5, read_only=read_only)
    # Every differing field is listed, a former "runtime" one (balancing) included.
    with pytest.raises(ConfigError, match=r"checkpoint step 2\).*model.d_model: 64 in the "
                       r"workdir vs 32 now; model.moe.balancing: 'qb' in the workdir vs 'sign'"):
      ckpt.restore_latest(_ABSTRACT, other)
    with pytest.raises(ConfigError, match="different train-state layout"):
      ckpt.restore_latest({"w": _ABSTRACT["w"]}, _MODEL)
    ckpt.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
  assert not os.path.exists(tmp_path / "checkpoints_corrupt")


def _legacy(model):
  """A model config as older code wrote it: runtime fields inside, no `vision` section."""
  old = json.loads(json.dumps(model, default=list))
  del old["vision"]
  old["dtype"] = "bfloat16"
  old["kda"].update(impl="recurrent", chunk_size=32)
  old["moe"]["capacity_factor"] = 1.25
  return old


def test_legacy_model_config_in_meta_and_workdir_is_accepted(tmp_path):
  _write(tmp_path, model=_legacy(_MODEL))
  (tmp_path / workdir_config.CONFIG_FILE).write_text(json.dumps(_legacy(_MODEL)))
  workdir_config.check_workdir_config(str(tmp_path), _MODEL)
  assert workdir_config.read_model_config(str(tmp_path)) == workdir_config.legacy_model_dict(_MODEL)
  for read_only in (True, False):
    r, _ = _restore(tmp_path, read_only)
    assert r.meta["step"] == 2 and "vision" in r.meta["model_config"]
    assert "capacity_factor" not in r.meta["model_config"]["moe"]
  bad = _legacy(_MODEL)
  bad["d_model"] = 48
  (tmp_path / workdir_config.CONFIG_FILE).write_text(json.dumps(bad))
  with pytest.raises(ConfigError, match="model.d_model: 48 in the workdir vs 64 now"):
    workdir_config.check_workdir_config(str(tmp_path), _MODEL)


def test_exported_params_are_checked_leaf_by_leaf(tmp_path):
  params = {"embed": jnp.ones((4, 2)), "layers": {"0": {"w": jnp.ones((2, 2))}}}
  path = params_export.export_params(str(tmp_path / "export"), nnx.State(params),
                                nnx.State({"b": jnp.zeros((3,))}), _MODEL)
  want = {"params": params, "routing_biases": {"b": jnp.zeros((3,))}}
  tree = loading.load_exported_params(path, expected=want)
  jax.tree.map(np.testing.assert_array_equal, tree, want)
  want["params"] = {"embed": jnp.ones((5, 2)), "head": jnp.ones((2,))}
  with pytest.raises(ValueError, match=r"the stored params do not match its model_config.json: "
                     r"head: missing; layers/0/w: unexpected; embed: shape \(4, 2\) stored vs "
                     r"\(5, 2\) from the config"):
    loading.load_exported_params(path, expected=want)
  with pytest.raises(FileExistsError):
    params_export.export_params(path, nnx.State(params), nnx.State({}), _MODEL)


def test_fingerprint_tolerance_scales_with_the_leaf_magnitude():
  """A leaf whose values cancel (sum 0.326, |x| sum 40): restored on another device count its
  sum moves by 3e-5 of itself, as seen after 2 processes x 4 devices -> 1 device."""
  assert ckpt_lib._same_fingerprint([0.32598209], [0.32597256], [40.0])
  assert not ckpt_lib._same_fingerprint([0.32598209], [0.32597256])   # no scale: older meta
  assert not ckpt_lib._same_fingerprint([0.32598209], [0.33598209], [40.0])  # 0.01 off
  sums, scale = ckpt_lib.fingerprints({"w": jnp.array([1.0, -2.0]), "n": jnp.array(3)})
  assert sums == [3.0, -1.0] and scale == [3.0, 3.0]


def test_relative_checkpoint_dir_resumes_and_another_is_refused(tmp_path, monkeypatch):
  """train.checkpoint_dir = 'ckpt' (a local path relative to the cwd) is recorded absolute;
  the same setting on the next start finds its checkpoints (was: refused as another
  location, so such a run could never resume); another directory is still refused."""
  monkeypatch.chdir(tmp_path)
  ckpt = ckpt_lib.Checkpointer("w", async_save=False, directory="ckpt")
  ckpt.save(1, _state(1), {}, {"model_config": _MODEL})
  ckpt.close()
  for given in ("ckpt", "ckpt/", str(tmp_path / "ckpt")):
    ckpt = ckpt_lib.Checkpointer("w", async_save=False, directory=given)
    assert ckpt.directory == str(tmp_path / "ckpt") and ckpt.latest_step() == 1
    ckpt.close()
  with pytest.raises(ConfigError, match="train.checkpoint_dir = 'other', but the checkpoints"):
    ckpt_lib.Checkpointer("w", async_save=False, directory="other")
