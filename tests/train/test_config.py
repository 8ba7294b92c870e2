"""The typed run config: sections, every bad field named with its allowed range, mesh sizes,
moved runtime fields, and configs saved by older runs."""

import dataclasses
import json

import ml_collections
import pytest

from hybridmoe_jax.config import ComputeConfig, ConfigError, migrate_legacy
from hybridmoe_jax.config.run import (DataConfig, MeshConfig, RunConfig, TrainConfig,
                                      VisionDataConfig, run_config_from_dict)
from hybridmoe_jax.parallel.mesh import mesh_shape
from hybridmoe_jax.config.run import default_config
from tests.conftest import load_config


@pytest.mark.parametrize("name", ["tiny", "small", "kimi_k3", "kimi_linear_48b", "tiny_vlm",
                                  "curriculum_cpu", "curriculum_1m"])
def test_defaults_and_presets_build(name):
  run = run_config_from_dict(load_config(name))
  assert isinstance(run, RunConfig) and run_config_from_dict(run) is run
  assert run_config_from_dict(default_config()) == RunConfig()


def test_presets_set_runtime_knobs_in_compute():
  assert run_config_from_dict(load_config("kimi_k3")).compute.dtype == "bfloat16"
  c = run_config_from_dict(load_config("curriculum_1m")).compute
  assert (c.dtype, c.remat) == ("bfloat16", "full")


def test_sections_present():
  c = default_config()
  assert set(c.keys()) == {"model", "compute", "train", "data", "mesh", "curriculum", "hardware",
                           "rl"}
  assert c.rl.envs.to_dict() == {}    # not an RL run
  assert c.hardware.to_dict() == {"device": "", "memory_gib": 0.0, "margin": 0.1,
                                  "topology": ""}
  assert c.mesh.to_dict() == {"data": 1, "fsdp": -1, "expert": 1, "tensor": 1,
                                "context": 1, "context_zigzag": False}
  assert c.compute.to_dict() == dataclasses.asdict(ComputeConfig())
  assert c.model.layer_kinds == ()  # the default pattern follows num_layers
  c.model.num_layers = 8
  assert run_config_from_dict(c).model.layer_kinds[3] == "mla"


def _with(section, **fields):
  """The default root config as a plain dict (no ConfigDict type-safety) with `fields` set."""
  c = default_config().to_dict()
  c[section].update(fields)
  return c


@pytest.mark.parametrize("field,value,match", [
    ("steps", 0, "train.steps"),
    ("batch_size", 0, "train.batch_size"),
    ("seq_len", 1, "train.seq_len"),
    ("grad_accum", 3, "divisor of batch_size"),
    ("schedule", "linear", "one of"),
    ("optimizer", "sgd", "one of"),
    ("lr", -1.0, "train.lr"),
    ("b2", 1.0, "train.b2"),
    ("warmup", -1, "train.warmup"),
    ("loss_spike_factor", 0.5, "loss_spike_factor"),
    ("clip", -1.0, "train.clip"),
    ("min_lr_ratio", 1.5, "train.min_lr_ratio"),
    ("eval_batches", 0, "train.eval_batches"),
])
def test_bad_train_fields(field, value, match):
  with pytest.raises(ConfigError, match=match):
    run_config_from_dict(_with("train", **{field: value}))


@pytest.mark.parametrize("section,fields,match", [
    ("train", {"stepz": 3}, r"unknown config field\(s\) train.stepz"),
    ("train", {"steps": "many"}, r"`train.steps` = 'many'.*an integer"),
    ("train", {"async_checkpoints": 1}, r"train.async_checkpoints.*True or False"),
    ("data", {"source": "web"}, "data.source"),
    ("data", {"source": "text"}, "data.paths.*at least one"),
    ("data", {"paths": ("",)}, "data.paths"),
    ("data", {"heldout_fraction": 0.9}, "data.heldout_fraction"),
    ("data", {"shuffle": "yes"}, "data.shuffle"),
    ("data", {"num_packing_bins": 0}, "data.num_packing_bins"),
    ("mesh", {"tensor": 0}, "mesh.tensor"),
    ("mesh", {"tensor": -1, "data": -1}, "at most one"),
    ("mesh", {"pipeline": 2}, "mesh.pipeline"),
    ("compute", {"dtype": "float16"}, "compute.dtype"),
    ("curriculum", {"num_workers": -1}, "curriculum.num_workers"),
    ("curriculum", {"eval_seq_len": -1}, "curriculum.eval_seq_len"),
])
def test_bad_section_fields(section, fields, match):
  with pytest.raises(ConfigError, match=match):
    run_config_from_dict(_with(section, **fields))


@pytest.mark.parametrize("fields,match", [
    ({"share": 0.0}, "data.vision.share"),
    ({"source": "web"}, "data.vision.source"),
    ({"source": "jsonl"}, "data.vision.paths"),
    ({"num_train": 0}, "data.vision.num_train"),
    ({"prompt_loss_weight": 1.5}, "data.vision.prompt_loss_weight"),
    ({"answer_loss_weight": 0.0}, "data.vision.answer_loss_weight"),
    ({"question_weights": {"count": 1.0}}, "data.vision.question_weights"),
    ({"question_weights": {"count": 1.0, "where": 0.0, "colour": 1.0}},
     "data.vision.question_weights"),
    ({"sides": (30,)}, r"data.vision.sides.*multiples of 2 \* patch_size = 16"),
    ({"sides": (64,)}, "data.vision.sides.*largest bucket 32"),
])
def test_bad_vision_data_fields(fields, match):
  c = load_config("tiny_vlm").to_dict()
  c["data"]["vision"].update(fields)
  with pytest.raises(ConfigError, match=match):
    run_config_from_dict(c)


@pytest.mark.parametrize("section,name,new", [
    ("train", "remat", "compute.remat"),
    ("model", "dtype", "compute.dtype"),
])
def test_moved_fields_in_a_user_config_are_refused(section, name, new):
  c = default_config()
  c[section][name] = "full" if name == "remat" else "bfloat16"  # an old preset's line
  with pytest.raises(ConfigError, match=rf"`{section}.{name}` moved to `{new}`"):
    run_config_from_dict(c)


def test_saved_config_of_an_older_run_migrates_and_takes_defaults():
  """A run config as 928f724 saved it (checkpoint meta "config"): moved fields land in
  compute, fields it lacks (whole sections, too) take today's defaults."""
  saved = json.loads(ml_collections.ConfigDict({
      "model": {"d_model": 16, "dtype": "bfloat16", "kda": {"chunk_size": 16, "impl": "auto"},
                "moe": {"capacity_factor": 0.0}},
      "train": {"steps": 3, "remat": "dots"}, "data": {"source": "bundled"}}).to_json())
  run = run_config_from_dict(migrate_legacy(saved))
  assert run.model.d_model == 16 and run.train.steps == 3
  assert run.compute == ComputeConfig(dtype="bfloat16", remat="dots", kda_chunk_size=16)
  assert run.data == DataConfig() and run.mesh == MeshConfig()


def test_typed_sections_are_frozen():
  run = RunConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.train.steps = 3  # type: ignore[misc]
  assert TrainConfig().steps == 300 and VisionDataConfig().share == 0.5


def test_mesh():
  shape = lambda m, n: mesh_shape(m.axis_sizes(), n)
  assert shape(MeshConfig(), 1) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, "context": 1}
  assert shape(MeshConfig(), 8)["fsdp"] == 8
  assert shape(MeshConfig(expert=4), 8) == {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1,
                                             "context": 1}
  with pytest.raises(ConfigError, match="mesh.fsdp"):
    shape(MeshConfig(expert=3), 8)
  with pytest.raises(ConfigError, match="product"):
    shape(MeshConfig(fsdp=2), 8)
  with pytest.raises(ConfigError, match="mesh.expert"):
    MeshConfig(expert=0)
  assert MeshConfig(context=4, context_zigzag=True).axis_sizes()["context"] == 4
  with pytest.raises(ConfigError, match=r"mesh.context_zigzag.*mesh.context > 1"):
    MeshConfig(context_zigzag=True)
