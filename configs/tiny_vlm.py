"""Tiny vision-language hybrid for CPU: configs/tiny.py + a 1-block vision tower (patch 8).

Trains jointly on generated digit scenes with question/answer text (data.vision) mixed with
the bundled text at a constant token share:
    python run_train.py --config=configs/tiny_vlm.py --workdir=runs/tiny_vlm
    python run_eval.py --workdir=runs/tiny_vlm --task=vqa
Images are 32 pixels square: 4x4 patches of 8x8 pixels -> 4 image tokens after the 2x2
merge, one per quadrant, so each 9x15-pixel digit glyph (data/images.py glyph_scale) lies
inside a single image token and "digit at top left?" is the lookup of one token, not the
assembly of a glyph cut across four. Layers KDA, MLA, KDA, MLA: the early softmax-attention
layer lets the answer position look the asked quadrant up by its 2-D position and the two
layers after it decode the digit (with MLA only last, tiny_vlm stayed at the majority rate on
which-digit-where).
"""

import pathlib

from hybridmoe_jax.train.config import load_config_file


def _tiny():
  return load_config_file(pathlib.Path(__file__).with_name("tiny.py"))


def get_config():
  config = _tiny()
  m = config.model
  m.vocab_size = 262              # bytes + pad/bos/eos + image_start/image_end/image_pad
  m.layer_kinds = ("kda", "mla", "kda", "mla")  # softmax lookup early, then decode
  v = m.vision
  v.enabled = True
  v.patch_size = 8                # p: 8 x 8 pixel patches (2 x 2 per quadrant)
  v.num_channels = 3
  v.width = 64                    # tower width D
  v.num_layers = 1                # one bidirectional encoder block per image
  v.num_heads = 2
  v.mlp_dim = 128
  v.native_grid = 4               # position table 4 x 4 (32-pixel images are native)
  v.projector_dim = 128
  v.image_buckets = (32,)         # padded side of a batch's images (one compilation)
  v.max_images_per_row = 16       # image slots per packed row (~10 Q/A pairs fit 384 tokens)
  d = config.data.vision
  d.share = 0.9                   # 90% of tokens from image-text documents, 10% bundled text
  d.source = "synthetic"
  d.sides = (32,)                 # one image token per quadrant (see the docstring)
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
