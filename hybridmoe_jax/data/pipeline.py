"""grain pipelines: documents -> shard -> shuffle -> repeat -> mix -> tokenize -> pack -> batch.

Every random choice is a pure function of (seed, element index), so the same arguments give
the same batches, and `it.get_state()` / `it.set_state(state)` (a small JSON-serialisable dict)
resume a run on exactly the batches it would have seen. Context-curriculum stages have their
own pipelines (stages.py: per-component mixing state, upsampling, retrieval documents).

Batches: {"tokens", "segment_ids", "positions"}, each int32 [B, T]; see packing.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from absl import logging
import grain
import numpy as np

from hybridmoe_jax.data import packing
from hybridmoe_jax.data import documents
from hybridmoe_jax.data import record_sources
from hybridmoe_jax.data import sources as sources_lib
from hybridmoe_jax.data import stages as stages_lib
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers.load import check_vocab, fingerprint, make_tokenizer
from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.run import DataConfig

Batch = dict[str, np.ndarray]


def make_pipeline(source, *, tokenizer: Tokenizer, seq_len: int,
                  batch_size: int, seed: int, weights: Sequence[float] | None = None,
                  shuffle: bool = True, num_epochs: int | None = None, shard_index: int = 0,
                  shard_count: int = 1, num_packing_bins: int = 16,
                  drop_remainder: bool = True, prefetch_batches: int = 0,
                  loss_weights: bool = False) -> grain.DatasetIterator:
  """Builds a checkpointable iterator of packed training batches.

  Args:
    source: a document source (len + __getitem__ -> str); with `weights`, a sequence of them.
    tokenizer: str -> int32 ids (BOS and EOS are added per document).
    seq_len: T, tokens per row.
    batch_size: B, rows per batch (per shard).
    seed: seeds the document shuffle (source k uses seed + k) and the packer's row order.
    weights: mixing proportions, one per source; mixtures repeat forever.
    shuffle: shuffle documents (a fresh permutation every epoch).
    num_epochs: passes over the documents; None repeats forever.
    shard_index, shard_count: this process reads documents shard_index::shard_count.
    num_packing_bins: rows the first-fit packer fills at once.
    drop_remainder: drop a last partial batch (keeps shapes static under jit).
    prefetch_batches: batches a background thread packs ahead (0: none); the state still
      names the next batch the caller will get.
    loss_weights: batches also carry "loss_weights" float32 [B, T] (1 per token, a retrieval
      document's answer weight on its answer tokens, 0 on padding; see packing.py).

  Returns:
    grain.DatasetIterator of {"tokens", "segment_ids", "positions"}: int32 [B, T].
  """
  if min(seq_len, batch_size) < 1:
    raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"need 0 <= shard_index ({shard_index}) < shard_count ({shard_count})")
  def docs(src, seed):  # one function with the curriculum's stages (same shard/shuffle/repeat)
    return stages_lib.component_docs(stages_lib.Component("data", src, 1.0), seed=seed,
                                     shard_index=shard_index, shard_count=shard_count,
                                     num_epochs=num_epochs, shuffle=shuffle)

  if weights is None:
    ds = docs(source, seed=seed)
  else:
    source, weights = list(source), [float(w) for w in weights]
    if len(source) != len(weights) or not source or min(weights) <= 0:
      raise ValueError(f"need one positive weight per source: {len(source)} sources, "
                       f"weights {weights}")
    if num_epochs is not None:
      raise ValueError("a weighted mixture repeats its sources forever; pass num_epochs=None")
    ds = grain.MapDataset.mix([docs(s, seed=seed + k) for k, s in enumerate(source)], weights)
  ds = documents.tokenize_documents(ds, tokenizer, loss_weights)
  ds = packing.pack_documents(ds, seq_len=seq_len, pad_id=tokenizer.pad_id, seed=seed,
                              num_packing_bins=num_packing_bins, loss_weights=loss_weights)
  ds = ds.batch(batch_size, drop_remainder=drop_remainder)
  if prefetch_batches:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch_batches)
  return iter(ds)


def _pad_rows(batch: Batch, batch_size: int, pad_id: int) -> Batch:
  """Fills a short last batch with all-padding rows (segment id 0) to a static [B, T]."""
  missing = batch_size - len(batch["tokens"])
  if missing == 0:
    return batch
  fill = {"tokens": pad_id, "segment_ids": 0, "positions": 0, "loss_weights": 0}
  return {k: np.concatenate([v, np.full((missing,) + v.shape[1:], fill[k], v.dtype)])
          for k, v in batch.items()}


def eval_batches(source, tokenizer: Tokenizer, seq_len: int, batch_size: int,
                 max_batches: int) -> list[Batch]:
  """One unshuffled pass over `source`, packed: the same list on every call.

  Returns:
    at most `max_batches` batches {"tokens", "segment_ids", "positions"}: int32 [B, T]; the
    last one is padded with segment-id-0 rows, so every held-out token is kept and shapes
    stay static.
  """
  if max_batches < 1:
    raise ValueError(f"max_batches must be >= 1, got {max_batches}")
  it = make_pipeline(source, tokenizer=tokenizer, seq_len=seq_len, batch_size=batch_size,
                     seed=0, shuffle=False, num_epochs=1, drop_remainder=False)
  return [_pad_rows(b, batch_size, tokenizer.pad_id) for b in itertools.islice(it, max_batches)]


def host_input_shards(input_shards: int, batch_size: int, process_index: int,
                      process_count: int) -> tuple[range, int]:
  """(the input shards this process reads, rows per shard batch).

  input_shards: data.input_shards (0: one per process); batch_size: this process's rows.
  Shards are given out in contiguous runs, so process p's rows are the global batch's rows
  [p * batch_size, (p + 1) * batch_size).

  Raises:
    ConfigError: a shard count that does not split over the processes or the batch (named).
  """
  n = input_shards or process_count
  if n % process_count:
    raise ConfigError(f"config field `data.input_shards` = {input_shards} is invalid: allowed "
                      f"a multiple of the {process_count} processes (or 0: one per process)")
  per = n // process_count
  if batch_size % per:
    raise ConfigError(f"config field `data.input_shards` = {input_shards} is invalid: each "
                      f"process's {batch_size} rows must split evenly over its {per} shards")
  return range(process_index * per, (process_index + 1) * per), batch_size // per


class ShardsIterator:
  """Several input shards' iterators as one: each batch is theirs concatenated along rows.

  State: {"input_shards": [state of each]}, JSON-able; restoring it resumes every shard.
  """

  def __init__(self, iterators: Sequence[grain.DatasetIterator]):
    self.iterators = list(iterators)

  def __iter__(self):
    return self

  def __next__(self) -> Batch:
    parts = [next(it) for it in self.iterators]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def get_state(self) -> dict:
    return {"input_shards": [it.get_state() for it in self.iterators]}

  def set_state(self, state: dict) -> None:
    states = state.get("input_shards") if isinstance(state, dict) else None
    if not isinstance(states, list) or len(states) != len(self.iterators):
      raise ConfigError(f"the saved data state holds {len(states or [])} input shards for this "
                        f"process, this run reads {len(self.iterators)}: resume with the same "
                        "data.input_shards and process count")
    for it, s in zip(self.iterators, states):
      it.set_state(s)

  def close(self) -> None:
    for it in self.iterators:
      if hasattr(it, "close"):
        it.close()


@dataclasses.dataclass(frozen=True)
class TrainEvalData:
  """What the train loop needs, of text (build_train_and_eval) or image-text data
  (vlm_pipeline.build_vlm_train_and_eval); keep the sources to rebuild pipelines for later
  stages."""

  train: Any  # batches int32 [B, T], forever: a grain.DatasetIterator / VLMPackedIterator
  eval_batches: list[Batch]  # held-out batches int32 [B_eval, T]
  tokenizer: Tokenizer
  train_source: Any  # text: sources.SubsetSource; image-text: any image-text source
  heldout_source: Any


def build_train_and_eval(data_cfg: DataConfig, *, vocab_size: int, seq_len: int,
                         batch_size: int, seed: int, eval_batch_size: int | None = None,
                         max_eval_batches: int = 16, shard_index: int = 0,
                         shard_count: int = 1,
                         tokenizer: Tokenizer | None = None) -> TrainEvalData:
  """Validates everything that can fail, then builds the train iterator and eval batches.

  Args:
    data_cfg: the `data` section (`run_config.DataConfig`).
    vocab_size: the model's vocabulary; must hold every tokenizer id.
    seq_len, batch_size, seed: as in make_pipeline (batch_size is per shard).
    eval_batch_size: rows per eval batch (default batch_size).
    max_eval_batches: cap on held-out batches.
    shard_index, shard_count: this process and the number of processes; it reads input
      shards `host_input_shards(data_cfg.input_shards, ...)`.
    tokenizer: default `make_tokenizer(data_cfg.tokenizer)`.

  Raises:
    ConfigError / ValueError / FileNotFoundError: bad config, missing path, no usable text,
      tokenizer ids beyond `vocab_size`; each names the offending field, path or value.
  """
  tokenizer = tokenizer or make_tokenizer(data_cfg.tokenizer)
  check_vocab(tokenizer, vocab_size)
  source = sources_lib.source_from_config(data_cfg)
  record_sources.check_tokenizer(source, tokenizer, fingerprint, "data.paths")
  train, heldout = sources_lib.split_source(source, data_cfg.heldout_fraction,
                                            data_cfg.heldout_seed)
  logging.info("data: %s source, %d documents: %d train, %d held out", data_cfg.source,
               len(source), len(train), len(heldout))
  mine, rows = host_input_shards(data_cfg.input_shards, batch_size, shard_index, shard_count)
  its = [make_pipeline(train, tokenizer=tokenizer, seq_len=seq_len, batch_size=rows,
                       seed=seed, shuffle=data_cfg.shuffle, shard_index=j,
                       shard_count=data_cfg.input_shards or shard_count,
                       num_packing_bins=data_cfg.num_packing_bins, prefetch_batches=2)
         for j in mine]
  it = its[0] if len(its) == 1 else ShardsIterator(its)
  evals = eval_batches(heldout, tokenizer, seq_len, eval_batch_size or batch_size,
                       max_eval_batches)
  return TrainEvalData(it, evals, tokenizer, train, heldout)
