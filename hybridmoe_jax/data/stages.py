"""Per-stage grain pipelines of a context curriculum and the iterator that walks the stages.

One stage's pipeline, per source ("component"):
  documents of this host's shard -> long-document upsampling -> shuffle (fresh permutation per
  epoch) -> repeat -> read + tokenize (a document that fails to read is skipped, counted)
then all components -> `IterDataset.mix` (deterministic interleave by weight; the iterator
state keeps each component's own position) -> first-fit packing with segment ids and
positions (packing.py) -> batch -> `mp_prefetch` when num_workers > 0 (else a prefetch thread).

`StagedIterator` yields the batches of stage 0 for its `steps`, then builds stage 1's pipeline
from scratch (a fresh packing iterator: no row straddles a stage boundary), and so on. Its
state is {"stage", "step_in_stage", "iterator"}: JSON-able, saved with every checkpoint, and
restoring it anywhere (also exactly at a boundary) resumes on exactly the batches an
uninterrupted run would have seen. With num_workers > 0 the batches depend on the number of
workers (grain slices documents per worker), so resume with the same num_workers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags
from absl import logging
import grain
import numpy as np

from hybridmoe_jax.data import packing
from hybridmoe_jax.data import documents
from hybridmoe_jax.data import sources as sources_lib
from hybridmoe_jax.data.tokenizers.base import Tokenizer

Batch = dict[str, np.ndarray]


# --------------------------------------------------------------------------- sources
def doc_lengths(source) -> np.ndarray:
  """int64 [n]: bytes per document (approximate for files: their size), cheap where possible."""
  if hasattr(source, "lengths"):
    return np.asarray(source.lengths, np.int64)
  if isinstance(source, sources_lib.SubsetSource):
    return doc_lengths(source.parent)[source.indices]
  if isinstance(source, sources_lib.SafeSource):
    return doc_lengths(source.source)
  if isinstance(source, sources_lib.TextFileSource):
    return np.asarray([os.path.getsize(f) for f in source.files], np.int64)
  return np.asarray([len(source[i].encode("utf-8")) for i in range(len(source))], np.int64)


def upsampled_indices(doc_ids: np.ndarray, lengths: np.ndarray, *, min_bytes: int,
                      factor: int) -> np.ndarray:
  """doc_ids, with each document of >= min_bytes bytes appearing `factor` times (sorted)."""
  doc_ids = np.asarray(doc_ids, np.int64)
  if factor <= 1:
    return doc_ids
  reps = np.where(lengths[doc_ids] >= min_bytes, factor, 1)
  return np.repeat(doc_ids, reps)


# --------------------------------------------------------------------------- one stage
@dataclasses.dataclass(frozen=True)
class Component:
  """One source of a stage and its mixing weight (> 0)."""

  name: str
  source: Any  # len + __getitem__ -> str
  weight: float


@dataclasses.dataclass(frozen=True)
class StageData:
  """What one stage's pipeline needs (batch_size is per host)."""

  index: int
  seq_len: int
  batch_size: int
  steps: int
  components: tuple[Component, ...]
  long_upsample: int = 1
  long_min_bytes: int = 0
  seed: int = 0
  loss_weights: bool = False  # batches carry "loss_weights" float32 [B, T] (packing.py)


def component_docs(comp: Component, *, seed: int, shard_index: int = 0, shard_count: int = 1,
                   long_upsample: int = 1, long_min_bytes: int = 0,
                   num_epochs: int | None = None, shuffle: bool = True) -> grain.MapDataset:
  """This host's documents of one component: str, or None for one that failed to read
  (SafeSource), upsampled, shuffled with `seed`, repeated `num_epochs` (None: forever)."""
  n = len(comp.source)
  # Shard whole documents first, then upsample inside the shard: a document (and its copies)
  # lives on exactly one host.
  doc_ids = np.arange(n, dtype=np.int64)[shard_index::shard_count]
  if len(doc_ids) == 0:
    raise ValueError(f"data source {comp.name!r}: shard {shard_index} of {shard_count} is "
                     f"empty (the source has {n} documents)")
  if long_upsample > 1:
    doc_ids = upsampled_indices(doc_ids, doc_lengths(comp.source), min_bytes=long_min_bytes,
                                factor=long_upsample)
  safe = (comp.source if isinstance(comp.source, sources_lib.SafeSource)
          else sources_lib.SafeSource(comp.source, comp.name))
  # A sharded, upsampled view: nothing is copied.
  ds = grain.MapDataset.source(sources_lib.SubsetSource(safe, doc_ids))
  if shuffle:
    ds = ds.shuffle(seed)
  return ds.repeat(num_epochs)


def make_stage_dataset(stage: StageData, *, tokenizer: Tokenizer,
                       shard_index: int = 0, shard_count: int = 1, num_packing_bins: int = 16,
                       num_workers: int = 0, prefetch_batches: int = 2,
                       num_epochs: int | None = None, shuffle: bool = True,
                       drop_remainder: bool = True) -> grain.IterDataset:
  """The packed, batched dataset of one stage: int32 [batch_size, seq_len] x 3 per element.

  Component k is shuffled with seed stage.seed + k; the packer uses stage.seed.
  num_epochs (None: forever) is only allowed with a single component.
  """
  if not stage.components:
    raise ValueError(f"stage {stage.index} has no data source with a positive weight")
  if num_epochs is not None and len(stage.components) > 1:
    raise ValueError("a weighted mixture repeats its sources forever; pass num_epochs=None")
  comps = [documents.tokenize_documents(
      component_docs(c, seed=stage.seed + k, shard_index=shard_index, shard_count=shard_count,
                     long_upsample=stage.long_upsample, long_min_bytes=stage.long_min_bytes,
                     num_epochs=num_epochs, shuffle=shuffle), tokenizer, stage.loss_weights)
      for k, c in enumerate(stage.components)]
  if len(comps) == 1:
    ds = comps[0]
  else:
    ds = grain.IterDataset.mix(comps, [c.weight for c in stage.components])
  ds = packing.pack_documents(ds, seq_len=stage.seq_len, pad_id=tokenizer.pad_id,
                              seed=stage.seed, num_packing_bins=num_packing_bins,
                              loss_weights=stage.loss_weights)
  ds = ds.batch(stage.batch_size, drop_remainder=drop_remainder)
  if num_workers > 0:
    # grain's worker processes read absl flags; outside `app.run` (tests, notebooks) they are
    # unparsed, which would crash the workers: take the defaults.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers,
                                                     per_worker_buffer_size=2))
  elif prefetch_batches:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch_batches)
  return ds


# --------------------------------------------------------------------------- all stages
class StagedIterator:
  """Batches of stage 0 for stages[0].steps batches, then stage 1, ...; checkpointable.

  Args:
    stages: in order; the last stage continues past its `steps` if asked for more.
    build: StageData -> a fresh grain iterator (get_state / set_state) for that stage.
  """

  def __init__(self, stages: Sequence[StageData], build: Callable[[StageData], Any]):
    if not stages:
      raise ValueError("StagedIterator needs at least one stage")
    self.stages, self._build = tuple(stages), build
    self._stage, self._in_stage = 0, 0
    self._it = None
    self._last = 0  # stage of the batch returned last

  def __iter__(self):
    return self

  def _at_boundary(self) -> bool:
    return (self._in_stage >= self.stages[self._stage].steps
            and self._stage + 1 < len(self.stages))

  def _open(self, stage: int, inner_state=None) -> None:
    self.close()
    self._stage, self._in_stage = stage, 0
    self._it = iter(self._build(self.stages[stage]))
    if inner_state is not None:
      self._it.set_state(inner_state)
    logging.info("data: stage %d (seq_len %d, batch %d) pipeline opened", stage,
                 self.stages[stage].seq_len, self.stages[stage].batch_size)

  def __next__(self) -> Batch:
    if self._at_boundary():
      self._open(self._stage + 1)
    elif self._it is None:
      self._open(self._stage)
    batch = next(self._it)
    self._in_stage += 1
    self._last = self._stage
    return batch

  def get_state(self) -> dict[str, Any]:
    """{"stage", "step_in_stage", "iterator"}; at a boundary: the next stage, not yet opened."""
    if self._at_boundary():
      return {"stage": self._stage + 1, "step_in_stage": 0, "iterator": None}
    inner = self._it.get_state() if self._it is not None and self._in_stage else None
    return {"stage": self._stage, "step_in_stage": self._in_stage, "iterator": inner}

  def set_state(self, state: dict[str, Any]) -> None:
    stage, n = int(state["stage"]), int(state["step_in_stage"])
    if not 0 <= stage < len(self.stages):
      raise ValueError(f"data state names stage {stage}, but the curriculum has "
                       f"{len(self.stages)} stages")
    if state.get("iterator") is None:
      if n:
        raise ValueError(f"data state at step {n} of stage {stage} lacks the iterator state")
      self.close()
      self._stage, self._in_stage, self._last = stage, 0, stage
      return
    self._open(stage, state["iterator"])
    self._in_stage, self._last = n, stage

  @property
  def stage(self) -> int:
    """Stage of the batch returned last."""
    return self._last

  @property
  def batch_shape(self) -> tuple[int, int]:
    """[B, T] of the batch returned last (per host)."""
    s = self.stages[self._last]
    return (s.batch_size, s.seq_len)

  def close(self) -> None:
    it, self._it = self._it, None
    if it is not None and hasattr(it, "close"):
      it.close()
