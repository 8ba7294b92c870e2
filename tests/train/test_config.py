"""validate_train_config / mesh resolution: every bad field is named with its allowed range."""

import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.train.config import default_config, mesh_shape, validate_train_config
from tests.conftest import load_config


def test_defaults_and_presets_validate():
  validate_train_config(default_config())
  for name in ("tiny", "kimi_k3"):
    validate_train_config(load_config(name))


def test_sections_present():
  c = default_config()
  assert set(c.keys()) >= {"model", "train", "data", "mesh"}
  assert c.mesh.to_dict() == {"data": 1, "fsdp": -1, "expert": 1, "tensor": 1}


@pytest.mark.parametrize("field,value,match", [
    ("steps", 0, "train.steps"),
    ("grad_accum", 3, "divisor of batch_size"),
    ("schedule", "linear", "one of"),
    ("optimizer", "sgd", "one of"),
    ("remat", "some", "one of"),
    ("lr", -1.0, "train.lr"),
    ("b2", 1.0, "train.b2"),
    ("warmup", -1, "train.warmup"),
    ("loss_spike_factor", 0.5, "loss_spike_factor"),
    ("clip", -1.0, "train.clip"),
])
def test_bad_train_fields(field, value, match):
  c = default_config()
  c.train[field] = value
  with pytest.raises(ConfigError, match=match):
    validate_train_config(c)


def test_ill_typed_override_is_refused_by_configdict():
  c = default_config()
  with pytest.raises(TypeError):
    c.train.steps = "many"


def test_mesh():
  c = default_config()
  assert mesh_shape(c.mesh, 1) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
  assert mesh_shape(c.mesh, 8)["fsdp"] == 8
  c.mesh.expert = 4
  assert mesh_shape(c.mesh, 8) == {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}
  c.mesh.tensor = 0
  with pytest.raises(ConfigError, match="mesh.tensor"):
    mesh_shape(c.mesh, 8)
  c.mesh.tensor, c.mesh.data = -1, -1
  with pytest.raises(ConfigError, match="at most one"):
    validate_train_config(c)
