"""configs/tiny.py with the BPE trained on the bundled corpus (1024 ids) instead of bytes.

At equal training compute (300 steps of 8 x 256 tokens) it reaches fewer bits per byte on
the held-out split than the byte tokenizer (BENCHMARKS.md "Tokenizers"):
    python run_train.py --config=configs/tiny_bpe.py --workdir=runs/tiny_bpe
The tokenizer is copied into the workdir (<workdir>/tokenizer/), so evals need no flag.
Needs the `tokenizers` extra (pip install -e ".[tokenizers]", included in [dev]).
"""

import pathlib

from hybridmoe_jax.config.flags import load_config_file

_HERE = pathlib.Path(__file__).resolve().parent


def get_config():
  config = load_config_file(_HERE / "tiny.py")
  # data/tokenizers/train_bpe.py --vocab_size 1024 on the train split (13 role tokens, 256 bytes, merges).
  config.data.tokenizer = str(_HERE / "tokenizers" / "bundled_bpe1024")
  config.model.vocab_size = 1024
  return config
