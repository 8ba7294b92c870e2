"""Shared by the vision tests: a small tower config and image / model helpers."""

import numpy as np

from hybridmoe_jax.config import VisionConfig, model_config_from_dict
from tests.conftest import load_config

P = 4
VIS = VisionConfig(enabled=True, patch_size=P, num_channels=3, width=16, num_layers=2,
                   num_heads=2, mlp_dim=32, native_grid=4, projector_dim=24,
                   image_buckets=(16, 32), max_images_per_row=3)


def vlm_cfg(kinds=("kda", "mla")):
  """tiny_vlm cut to len(kinds) layers (the last one MoE) to keep compile times short, with
  patch 4 and buckets (16, 32) so the small test images below give several image tokens."""
  m = load_config("tiny_vlm").model
  m.num_layers, m.layer_kinds = len(kinds), kinds
  m.vision.patch_size, m.vision.image_buckets = 4, (16, 32)
  m.moe.first_dense_layers = len(kinds) - 1
  return model_config_from_dict(m)


def rand_img(rng, h, w, c=3):
  return rng.integers(0, 256, (h, w, c), dtype=np.uint8)
