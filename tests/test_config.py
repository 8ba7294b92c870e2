"""Config validation: every bad value names its field and the allowed range."""

import ml_collections
import pytest

from hybridmoe_jax.config import (ComputeConfig, ConfigError, MoEConfig, default_layer_kinds,
                                  from_dict, migrate_legacy, model_config_from_dict)
from tests.conftest import load_config


@pytest.mark.parametrize("override, field", [
    ({"kda": {"num_heads": 3, "num_v_heads": 4}}, "model.kda.num_v_heads"),
    ({"kda": {"lower_bound": -5.5}}, "model.kda.lower_bound"),
    ({"kda": {"lower_bound": 0.0}}, "model.kda.lower_bound"),
    ({"kda": {"gate": "relu"}}, "model.kda.gate"),
    ({"moe": {"num_experts": 4, "experts_per_token": 4}}, "model.moe.experts_per_token"),
    ({"moe": {"latent_dim": 64}}, "model.moe.latent_dim"),
    ({"moe": {"glu": "gelu"}}, "model.moe.glu"),
    ({"moe": {"balancing": "aux"}}, "model.moe.balancing"),
    ({"layer_kinds": ["kda", "mla", "ssm", "mla"]}, "model.layer_kinds[2]"),
    ({"layer_kinds": ["kda", "mla"]}, "model.layer_kinds"),
    ({"d_model": 0}, "model.d_model"),
    ({"d_model": "64"}, "model.d_model"),
    ({"norm_eps": "small"}, "model.norm_eps"),
    ({"attnres": {"enabled": 1}}, "model.attnres.enabled"),
    ({"vision": {"enabled": True, "image_buckets": (224, 100)}}, "model.vision.image_buckets"),
    ({"vision": {"enabled": True, "image_buckets": "224"}}, "model.vision.image_buckets"),
    ({"kda": 3}, "model.kda"),
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


@pytest.mark.parametrize("override, field", [
    ({"dtype": "float16"}, "compute.dtype"),
    ({"remat": "some"}, "compute.remat"),
    ({"kda_impl": "fast"}, "compute.kda_impl"),
    ({"kda_chunk_size": 48}, "compute.kda_chunk_size"),
    ({"kda_chunk_size": 8}, "compute.kda_chunk_size"),
    ({"moe_impl": "sparse"}, "compute.moe_impl"),
    ({"mla_impl": "flash"}, "compute.mla_impl"),
    ({"moe_capacity_factor": -1.0}, "compute.moe_capacity_factor"),
    ({"moe_capacity_factor": "big"}, "compute.moe_capacity_factor"),
    ({"kda_chunks": 64}, "compute.kda_chunks"),
])
def test_bad_compute_values_name_the_field(override, field):
  with pytest.raises(ConfigError, match=field):
    from_dict(ComputeConfig, override, "compute")


def test_checker_coerces_types():
  cfg = model_config_from_dict({"layer_kinds": ["kda", "kda", "kda", "mla"],
                                "moe": {"routed_scale": 2}, "vision": {"image_buckets": [28, 56]}})
  assert cfg.layer_kinds == ("kda", "kda", "kda", "mla") and cfg.moe.routed_scale == 2.0
  assert isinstance(cfg.moe.routed_scale, float) and cfg.vision.image_buckets == (28, 56)
  assert from_dict(ComputeConfig, {"moe_capacity_factor": 2}).moe_capacity_factor == 2.0
  assert [from_dict(ComputeConfig, {"mla_impl": i}).mla_impl
          for i in ("cudnn", "triton", "splash")] == ["cudnn", "triton", "splash"]
  assert from_dict(MoEConfig, None) == MoEConfig()


@pytest.mark.parametrize("override, old, new", [
    ({"dtype": "bfloat16"}, "model.dtype", "compute.dtype"),
    ({"kda": {"impl": "chunked"}}, "model.kda.impl", "compute.kda_impl"),
    ({"kda": {"chunk_size": 16}}, "model.kda.chunk_size", "compute.kda_chunk_size"),
    ({"moe": {"capacity_factor": 1.5}}, "model.moe.capacity_factor",
     "compute.moe_capacity_factor"),
])
def test_moved_fields_name_their_new_place(override, old, new):
  with pytest.raises(ConfigError, match=f"`{old}` moved to `{new}`"):
    model_config_from_dict(override)


def test_migrate_legacy_moves_runtime_fields():
  old = {"model": {"d_model": 16, "dtype": "bfloat16",
                   "kda": {"impl": "chunked", "chunk_size": 16, "num_heads": 2},
                   "moe": {"capacity_factor": 1.5}},
         "train": {"remat": "full", "steps": 3}}
  new = migrate_legacy(old)
  assert new["compute"] == {"dtype": "bfloat16", "kda_impl": "chunked", "kda_chunk_size": 16,
                            "moe_capacity_factor": 1.5, "remat": "full"}
  assert new["model"] == {"d_model": 16, "kda": {"num_heads": 2}, "moe": {}}
  assert new["train"] == {"steps": 3}
  assert old["model"]["dtype"] == "bfloat16"  # the input is left as it was
  # A compute section already present wins; a model-only dict migrates under "model".
  assert migrate_legacy({"model": {"dtype": "bfloat16"}, "compute": {"dtype": "float32"}}
                        )["compute"] == {"dtype": "float32"}
  model = migrate_legacy({"model": {"dtype": "float32", "d_model": 16}})["model"]
  assert model_config_from_dict(model).d_model == 16
  assert migrate_legacy(ml_collections.ConfigDict(old)) == new  # a ConfigDict as well


def test_tpu_slice_names_below_the_smallest_torus_are_refused():
  """'v5p-4' (2 chips) resolved to the 4-chip torus 'v5p:2x2x1' with a count of 2: a
  topology that is not the slice's (launch recipes asked for 2 chips of a 2x2x1 node pool)."""
  from hybridmoe_jax.config.hardware import HardwareConfig, parse_topology
  for bad in ("v5p-4", "v5p-2", "v4-4"):
    with pytest.raises(ConfigError, match=r"hardware\.topology") as e:
      HardwareConfig(topology=bad)
    assert "\n" not in str(e.value)
  for name, want in (("v5p-8", ("tpu_v5p", "v5p:2x2x1", 4)), ("v5e-1", ("tpu_v5e", "v5e:1x1", 1)),
                     ("v6e-2", ("tpu_v6e", "v6e:2x1", 2))):
    assert parse_topology(name) == want


def test_generated_image_sides_below_ten_pixels_are_refused():
  """data.vision.sides of 8 (a multiple of 2 * patch_size = 4) passed the config and the
  synthetic scene source then raised a bare ValueError (a 2x2 grid of 5-pixel glyphs)."""
  from hybridmoe_jax.config.run import run_config_from_dict
  vision = {"enabled": True, "patch_size": 2, "image_buckets": [8, 16], "width": 16,
            "num_heads": 2}
  with pytest.raises(ConfigError, match=r"config field `data.vision.sides\[0\]` = 8 .*>= 10"):
    run_config_from_dict({"model": {"vision": vision}, "data": {"vision": {"sides": [8, 12]}}})
  assert run_config_from_dict({"model": {"vision": vision},
                               "data": {"vision": {"sides": [12, 16]}}}).data.vision.sides == (
                                   12, 16)


def test_vision_held_out_scenes_and_curriculum_answer_weights_are_checked():
  """Synthetic held-out scenes drawn with the training seed are the training scenes; a vision
  model's curriculum cannot weight retrieval answers (the image-text packer keeps a text
  document's tokens only): both passed the config and trained silently."""
  from hybridmoe_jax.config.run import run_config_from_dict
  with pytest.raises(ConfigError, match=r"`data.vision.heldout_seed` = 3 .*train_seed=3"):
    run_config_from_dict({"data": {"vision": {"train_seed": 3, "heldout_seed": 3}}})
  stage = {"seq_len": 256, "steps": 2, "weights": {"doc": 1.0}, "retrieval_fraction": 0.2,
           "retrieval_answer_weight": 5.0}
  curriculum = {"tokens_per_step": 512, "sources": {"doc": {"kind": "bundled"}},
                "stages": [stage]}
  vision = {"enabled": True, "patch_size": 2, "image_buckets": [28, 56], "width": 16,
            "num_heads": 2}
  with pytest.raises(ConfigError, match=r"stages\[0\].retrieval_answer_weight` = 5.0 .*vision"):
    run_config_from_dict({"model": {"vision": vision}, "curriculum": curriculum,
                          "train": {"steps": 2}})
  assert run_config_from_dict({"curriculum": curriculum, "train": {"steps": 2}})  # text: fine
