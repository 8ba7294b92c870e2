"""Tiny vision-language hybrid for CPU: configs/tiny.py + a 1-block vision tower (patch 4).

Trains jointly on generated digit scenes with question/answer text (data.vision) mixed with
the bundled text at a constant token share:
    python run_train.py --config=configs/tiny_vlm.py --workdir=runs/tiny_vlm
    python run_eval.py --workdir=runs/tiny_vlm --task=vqa
Images are 16 or 32 pixels square: 4x4 or 8x8 patches -> 4 or 16 image tokens after the
2x2 merge; batches pad to the 16- or 32-pixel bucket (two compilations of the step).
"""

import pathlib

from hybridmoe_jax.train.config import load_config_file


def _tiny():
  return load_config_file(pathlib.Path(__file__).with_name("tiny.py"))


def get_config():
  config = _tiny()
  m = config.model
  m.vocab_size = 262              # bytes + pad/bos/eos + image_start/image_end/image_pad
  v = m.vision
  v.enabled = True
  v.patch_size = 4                # p: 4 x 4 pixel patches
  v.num_channels = 3
  v.width = 64                    # tower width D
  v.num_layers = 1                # one bidirectional encoder block per image
  v.num_heads = 2
  v.mlp_dim = 128
  v.native_grid = 4               # position table 4 x 4 (16-pixel images are native)
  v.projector_dim = 128
  v.image_buckets = (16, 32)      # padded sides of a batch's images (one compile each)
  v.max_images_per_row = 8       # image slots per packed row
  d = config.data.vision
  d.share = 0.9                   # 90% of tokens from image-text documents, 10% bundled text
  d.source = "synthetic"
  d.sides = (16, 32)
  d.num_heldout = 64
  t = config.train
  t.steps = 900
  t.batch_size = 6
  t.seq_len = 384               # a whole scene document (image + all Q/A) fits a row
  t.warmup = 30
  t.eval_every = 450
  t.checkpoint_every = 250
  t.heatmap_every = 0
  return config
