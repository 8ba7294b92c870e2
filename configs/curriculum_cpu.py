"""Staged context curriculum on the tiny model for CPU: 256 -> 1K -> 4K -> 8K -> 32K -> 64K.

8,192 tokens per step up to 8K (batch 32 -> 8 -> 2 -> 1), then one 32K and one 64K row per
step; the mix shifts from pydoc help texts toward standard-library packages (long documents,
upsampled in the later stages) plus a share of synthetic passkey / key-value recall
documents. After every stage: held-out loss at that stage's length and at 64K, and a passkey
NIAH grid at 1K-64K (workdir/eval/niah_stage<k>.{json,png}). 320 steps, 3.2M tokens, ~45 min
on an idle 2-core box; see BENCHMARKS.md for the measured run.

  python run_train.py --config=configs/curriculum_cpu.py --workdir=runs/curriculum_cpu
"""

import pathlib

from hybridmoe_jax.config.flags import load_config_file


def _tiny():
  return load_config_file(pathlib.Path(__file__).with_name("tiny.py"))


def get_config():
  config = _tiny()
  # The plain byte vocabulary its BENCHMARKS figures were measured with.
  config.data.tokenizer, config.model.vocab_size = "byte", 259
  c = config.curriculum
  c.tokens_per_step = 8192
  c.sources = {"pydoc": {"kind": "bundled"}, "stdlib": {"kind": "stdlib_long"}}
  c.num_workers = 0                 # 2 cores: the packer thread shares them with the step
  c.stages = (
      dict(name="short", seq_len=256, steps=150, weights={"pydoc": 0.5, "stdlib": 0.5},
           lr=3e-3, warmup=20, schedule="cosine", min_lr_ratio=0.3),
      dict(name="1k", seq_len=1024, steps=70, weights={"pydoc": 0.4, "stdlib": 0.6},
           lr=1.5e-3, warmup=10, schedule="wsd", min_lr_ratio=0.5, decay_fraction=0.3),
      dict(name="4k", seq_len=4096, steps=40, weights={"pydoc": 0.3, "stdlib": 0.7},
           long_upsample=2, retrieval_fraction=0.05,
           lr=1e-3, warmup=5, schedule="wsd", min_lr_ratio=0.5, decay_fraction=0.3),
      dict(name="8k", seq_len=8192, steps=40, weights={"pydoc": 0.2, "stdlib": 0.8},
           long_upsample=3, retrieval_fraction=0.05,
           lr=7e-4, warmup=5, schedule="wsd", min_lr_ratio=0.5, decay_fraction=0.3),
      dict(name="32k", seq_len=32768, steps=16, tokens_per_step=32768,
           weights={"pydoc": 0.1, "stdlib": 0.9}, long_upsample=3, retrieval_fraction=0.1,
           lr=5e-4, warmup=2, schedule="wsd", min_lr_ratio=0.5, decay_fraction=0.3),
      dict(name="64k", seq_len=65536, steps=4, tokens_per_step=65536,
           weights={"pydoc": 0.1, "stdlib": 0.9}, long_upsample=3, retrieval_fraction=0.1,
           lr=4e-4, warmup=1, schedule="cosine", min_lr_ratio=0.1),
  )
  c.niah_lengths = (1024, 4096, 16384, 65536)
  c.niah_depths = (0.1, 0.5, 0.9)
  c.niah_samples = 2
  t = config.train
  t.steps = sum(s["steps"] for s in c.stages)
  t.eval_every = 0                  # held-out eval at every stage end (and at the end)
  t.eval_batches = 2                # 2 x 64K held-out tokens (and as many at each stage's length)
  t.checkpoint_every = 50
  t.heatmap_every = 100
  return config
