"""Config validation: every bad value names its field and the allowed range."""

import pytest

from hybridmoe_jax.config import ConfigError, default_layer_kinds, model_config_from_dict
from tests.conftest import load_config


@pytest.mark.parametrize("override, field", [
    ({"kda": {"num_heads": 3, "num_v_heads": 4}}, "model.kda.num_v_heads"),
    ({"kda": {"chunk_size": 48}}, "model.kda.chunk_size"),
    ({"kda": {"chunk_size": 8}}, "model.kda.chunk_size"),
    ({"kda": {"lower_bound": -5.5}}, "model.kda.lower_bound"),
    ({"kda": {"lower_bound": 0.0}}, "model.kda.lower_bound"),
    ({"kda": {"gate": "relu"}}, "model.kda.gate"),
    ({"kda": {"impl": "fast"}}, "model.kda.impl"),
    ({"moe": {"num_experts": 4, "experts_per_token": 4}}, "model.moe.experts_per_token"),
    ({"moe": {"latent_dim": 64}}, "model.moe.latent_dim"),
    ({"moe": {"glu": "gelu"}}, "model.moe.glu"),
    ({"moe": {"balancing": "aux"}}, "model.moe.balancing"),
    ({"layer_kinds": ["kda", "mla", "ssm", "mla"]}, "model.layer_kinds[2]"),
    ({"layer_kinds": ["kda", "mla"]}, "model.layer_kinds"),
    ({"d_model": 0}, "model.d_model"),
    ({"d_model": "64"}, "model.d_model"),
    ({"dtype": "float16"}, "model.dtype"),
    ({"mla": {"num_heads": -1}}, "model.mla.num_heads"),
    ({"attnres": {"block_size": 0}}, "model.attnres.block_size"),
    ({"kda": {"heads": 2}}, "model.kda.heads"),
])
def test_bad_values_name_the_field(override, field):
  with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
    model_config_from_dict(override)


def test_default_layer_pattern_matches_published_models():
  k3 = default_layer_kinds(93)
  assert [i + 1 for i, k in enumerate(k3) if k == "mla"] == list(range(4, 93, 4)) + [93]
  assert k3.count("kda") == 69
  k48 = default_layer_kinds(27)
  assert [i + 1 for i, k in enumerate(k48) if k == "mla"] == list(range(4, 25, 4)) + [27]


@pytest.mark.parametrize("name", ["tiny", "small", "kimi_linear_48b", "kimi_k3"])
def test_presets_validate(name):
  cfg = model_config_from_dict(load_config(name).model)
  assert cfg.num_layers == len(cfg.layer_kinds)
