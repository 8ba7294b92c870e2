"""The run's inputs: the tokenizer of `data.tokenizer`, the train iterator and held-out
batches (text, image-text or a curriculum's stages), and the cheap checks every host batch
passes (shape, dtype, token range) before it reaches the step.
"""

from __future__ import annotations

import jax
import numpy as np

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.data import curriculum as data_curriculum
from hybridmoe_jax.data import pipeline as data_pipeline
from hybridmoe_jax.data import tokenizer as tokenizer_lib
from hybridmoe_jax.data import vlm_pipeline
from hybridmoe_jax.run_config import RunConfig
from hybridmoe_jax.train import plan as plan_lib
from hybridmoe_jax.train.run_errors import InputError


def run_tokenizer(run: RunConfig, *, check_vocab: bool = True) -> tokenizer_lib.Tokenizer:
  """The tokenizer of `data.tokenizer` (image roles for a vision model), checked against
  model.vocab_size. Raises InputError (one line naming the file / field) before any compute."""
  try:
    tok = tokenizer_lib.make_tokenizer(run.data.tokenizer, vision=run.model.vision.enabled)
    if check_vocab:
      tokenizer_lib.check_vocab(tok, run.model.vocab_size)
  except ValueError as e:
    raise InputError(f"data.tokenizer: {e}" if not str(e).startswith("data.tokenizer")
                     else str(e)) from None
  return tok


def build_data(run: RunConfig, plan: plan_lib.Plan,
               tokenizer: tokenizer_lib.Tokenizer | None = None):
  """Train iterator + held-out batches: the curriculum's stages, image-text + text for a
  vision model, else the `data` section's text (`hybridmoe_jax.data.pipeline`).

  tokenizer: default `run_tokenizer(run)`; the data's `.tokenizer` is this one."""
  cfg, t = run.model, run.train
  tokenizer = tokenizer or run_tokenizer(run)
  try:
    if plan.curriculum:  # staged context curriculum (data/curriculum.py)
      return data_curriculum.build_curriculum_data(
          plan.stages, run.curriculum, run.data, vocab_size=cfg.vocab_size, seed=t.seed,
          eval_batches=t.eval_batches, vision=cfg.vision, tokenizer=tokenizer)
    if cfg.vision.enabled:  # image-text mixed with text (data/vlm_pipeline.py)
      return vlm_pipeline.build_vlm_train_and_eval(
          run.data, cfg.vision, vocab_size=cfg.vocab_size, seq_len=t.seq_len,
          batch_size=t.batch_size, seed=t.seed, max_eval_batches=t.eval_batches,
          tokenizer=tokenizer)
    # Multi-host: each process loads its own batch_size / process_count rows (its shard).
    return data_pipeline.build_train_and_eval(
        run.data, vocab_size=cfg.vocab_size, seq_len=t.seq_len,
        batch_size=t.batch_size // jax.process_count(), seed=t.seed,
        max_eval_batches=t.eval_batches, shard_index=jax.process_index(),
        shard_count=jax.process_count(), tokenizer=tokenizer)
  except ConfigError:
    raise
  except (ValueError, OSError) as e:  # missing path, empty dataset, ids beyond the vocab
    raise InputError(f"data: {e}") from e


def check_batch(batch: dict[str, np.ndarray], t, vocab_size: int, step: int,
                want: tuple[int, int] | None = None) -> None:
  """Shape, dtype and token-range checks on a host batch (cheap, every step).

  `want`: the expected [rows, seq_len] (a curriculum stage's); default from `t`.
  """
  want = want or (t.batch_size // jax.process_count(), t.seq_len)  # this process's rows
  for key in ("tokens", "segment_ids"):
    if key not in batch:
      raise InputError(f"data batch at step {step} has no {key!r} field (got {sorted(batch)})")
    arr = np.asarray(batch[key])
    if arr.shape != want or not np.issubdtype(arr.dtype, np.integer):
      raise InputError(f"data batch at step {step}: {key} has shape {arr.shape} dtype "
                       f"{arr.dtype}; expected integer [batch_size, seq_len] = {list(want)}")
  tokens = np.asarray(batch["tokens"])
  lo, hi = int(tokens.min()), int(tokens.max())
  if lo < 0 or hi >= vocab_size:
    bad = hi if hi >= vocab_size else lo
    raise InputError(f"data batch at step {step} holds token id {bad}, outside the model "
                     f"vocabulary [0, {vocab_size}) (model.vocab_size = {vocab_size})")


def next_batch(it, t, vocab_size: int, step: int) -> dict[str, np.ndarray]:
  try:
    batch = next(it)
  except StopIteration:
    raise InputError(f"the training data ran out at step {step}: the dataset is empty or "
                     "too small for one batch of "
                     f"{t.batch_size} x {t.seq_len} tokens") from None
  check_batch(batch, t, vocab_size, step, getattr(it, "batch_shape", None))
  return batch
