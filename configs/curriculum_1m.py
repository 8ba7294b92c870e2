"""Staged context curriculum 8K -> 64K -> 256K -> 1M on the ~100M model, for accelerators.

4M tokens per step throughout (global batch 512 -> 64 -> 16 -> 4), the mix moving from short
help texts to long standard-library packages (upsampled) with a small share of synthetic
retrieval documents; each longer stage re-warms to a lower constant learning rate and decays.

  python run_train.py --config=configs/curriculum_1m.py --dry_run   # plan + memory per stage

Target hardware: 16 x H200 (141 GB each), mesh fsdp=4 x context=4; the dry run checks every
stage against 85% of the device memory.
"""

import pathlib

from hybridmoe_jax.config.flags import load_config_file


def _small():
  return load_config_file(pathlib.Path(__file__).with_name("small.py"))


def get_config():
  config = _small()
  config.compute.dtype = "bfloat16"
  config.compute.remat = "full"    # see the per-stage memory estimate of --dry_run
  c = config.curriculum
  c.tokens_per_step = 1 << 22
  c.sources = {"pydoc": {"kind": "bundled"}, "stdlib": {"kind": "stdlib_long"}}
  c.num_workers = 8
  c.stages = (
      dict(name="8k", seq_len=8192, tokens=40 * 2 ** 30, weights={"pydoc": 0.6, "stdlib": 0.4},
           lr=3e-4, warmup=2000, schedule="cosine", min_lr_ratio=0.3),
      dict(name="64k", seq_len=65536, tokens=4 * 2 ** 30, weights={"pydoc": 0.4, "stdlib": 0.6},
           long_upsample=2, retrieval_fraction=0.02,
           lr=1e-4, warmup=100, schedule="wsd", min_lr_ratio=0.3, decay_fraction=0.3),
      dict(name="256k", seq_len=262144, tokens=2 * 2 ** 30, weights={"pydoc": 0.3, "stdlib": 0.7},
           long_upsample=4, retrieval_fraction=0.03,
           lr=6e-5, warmup=50, schedule="wsd", min_lr_ratio=0.3, decay_fraction=0.3),
      dict(name="1m", seq_len=1048576, tokens=1 * 2 ** 30, weights={"pydoc": 0.2, "stdlib": 0.8},
           long_upsample=8, retrieval_fraction=0.05,
           lr=3e-5, warmup=25, schedule="cosine", min_lr_ratio=0.1),
  )
  t = config.train
  t.steps = sum(s["tokens"] for s in c.stages) // c.tokens_per_step
  t.eval_every = 0
  t.eval_batches = 1
  t.checkpoint_every = 500
  # Target: 16 H200s (two 8-GPU hosts). Every stage holds 4M tokens per step, 256K per
  # device; the 1M stage has 4 sequences for 16 devices, so each sequence is split over 4
  # context shards (KDA state fold, gathered MLA latents), and fsdp takes the rest.
  m = config.mesh
  m.data, m.fsdp, m.expert, m.tensor, m.context = 1, 4, 1, 1, 4
  config.hardware.device = "h200"
  config.hardware.margin = 0.15
  return config
