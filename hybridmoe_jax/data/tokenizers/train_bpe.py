"""Train a small byte-level BPE on a run's training documents, offline, as a tokenizer.json.

    python -m hybridmoe_jax.data.tokenizers.train_bpe --out configs/tokenizers/bundled_bpe1024 \\
        --vocab_size 1024

The documents are the TRAIN split of the `data` section (default: the bundled corpus with
the default held-out fraction and seed), so the held-out documents the runs evaluate on are
never seen. Byte-level (the GPT-2 alphabet of 256 bytes) so every string is encodable; the
special tokens of every role (pad, bos, eos, the chat roles, the image roles) come first,
ids 0..12, so one file serves text and vision models with the same ids. The vocabulary
counts them: vocab_size = 13 specials + 256 bytes + merges.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator, Sequence

from hybridmoe_jax.data import sources as sources_lib
from hybridmoe_jax.data.tokenizers.base import (CHAT_ROLES, IMAGE_ROLES, ROLE_TOKENS,
                                                TEXT_ROLES, TokenizerError, import_optional)
from hybridmoe_jax.data.tokenizers.hf import HF_FILE
from hybridmoe_jax.config.run import DataConfig

SPECIAL_TOKENS = tuple(ROLE_TOKENS[r][0]
                       for r in TEXT_ROLES + CHAT_ROLES + IMAGE_ROLES)
MIN_VOCAB = len(SPECIAL_TOKENS) + 256


def training_documents(data_cfg: DataConfig) -> Iterator[str]:
  """The train split of `data_cfg`'s source (the held-out split is left out)."""
  source = sources_lib.source_from_config(data_cfg)
  train, _ = sources_lib.split_source(source, data_cfg.heldout_fraction, data_cfg.heldout_seed)
  for i in range(len(train)):
    yield train[i]


def train_bpe(documents, vocab_size: int, *, min_frequency: int = 2):
  """-> a `tokenizers.Tokenizer`: byte-level BPE of `vocab_size` ids (specials first).

  Raises:
    TokenizerError: vocab_size below specials + 256 bytes, or `tokenizers` missing.
  """
  if vocab_size < MIN_VOCAB:
    raise TokenizerError(f"--vocab_size {vocab_size} is too small: allowed >= {MIN_VOCAB} "
                         f"({len(SPECIAL_TOKENS)} special tokens + 256 bytes)")
  lib = import_optional("tokenizers")
  tok = lib.Tokenizer(lib.models.BPE())
  # No prefix space: the tokens of a text are exactly its bytes, so decode(encode(t)) == t.
  tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = lib.decoders.ByteLevel()
  trainer = lib.trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(documents, trainer)
  return tok


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="directory for tokenizer.json (new file)")
  parser.add_argument("--vocab_size", type=int, default=1024)
  parser.add_argument("--min_frequency", type=int, default=2)
  parser.add_argument("--source", default="bundled", help="data.source: bundled, text, jsonl")
  parser.add_argument("--paths", nargs="*", default=[], help="data.paths for text / jsonl")
  args = parser.parse_args(argv)
  out = os.path.join(args.out, HF_FILE)
  try:
    if os.path.exists(out):
      raise TokenizerError(f"--out {args.out} already holds {HF_FILE}; "
                           "choose a new directory (files are never overwritten)")
    data_cfg = DataConfig(source=args.source, paths=tuple(args.paths))
    tok = train_bpe(training_documents(data_cfg), args.vocab_size,
                    min_frequency=args.min_frequency)
    os.makedirs(args.out, exist_ok=True)
    tok.save(out)
  except (ValueError, OSError) as e:  # ConfigError and TokenizerError are ValueErrors
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {out}: {tok.get_vocab_size()} ids")
  return 0


if __name__ == "__main__":
  sys.exit(main())
