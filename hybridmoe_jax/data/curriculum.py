"""The data of a staged context curriculum: per-stage sources and pipelines, held-out set.

The stages come resolved from the plan (`train/stage_plan.py`: global batch, length, mixing
weights per stage); here every named source of `curriculum.sources` is indexed and split
into train / held-out documents (`data.heldout_fraction` / `data.heldout_seed`), each stage
becomes a `stages.StageData` (retrieval documents join as one more component) and the
`stages.StagedIterator` walks them. Held-out batches are packed at the longest stage length
(or curriculum.eval_seq_len) and evaluated at every stage end.

A vision model gets image-text documents (`data.vision`) mixed into every stage at the token
share data.vision.share, packed by the image-aware packer in-process (curriculum.num_workers
does not apply; one host only).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

from absl import logging
import jax
import numpy as np

from hybridmoe_jax.config import ConfigError, VisionConfig
from hybridmoe_jax.data import multimodal
from hybridmoe_jax.data import pipeline as pipeline_lib
from hybridmoe_jax.data import record_sources
from hybridmoe_jax.data import retrieval
from hybridmoe_jax.data import sources as sources_lib
from hybridmoe_jax.data import stages as stages_lib
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers.load import check_vocab, fingerprint, make_tokenizer
from hybridmoe_jax.data import vlm_pipeline
from hybridmoe_jax.config.run import CurriculumConfig, DataConfig


class Stage(Protocol):
  """What the data needs of one resolved stage (`train/stage_plan.py: StagePlan` has it)."""

  index: int
  seq_len: int
  batch_size: int            # global rows per step
  steps: int
  weights: dict[str, float]  # {source name: weight > 0}
  long_upsample: int
  long_min_bytes: int
  retrieval_fraction: float
  retrieval_answer_weight: float  # loss weight of retrieval answer tokens (1: plain)
  retrieval_kinds: tuple[str, ...]
  retrieval_bytes: tuple[int, int]  # (shortest, longest) retrieval document in bytes

  @property
  def end_step(self) -> int: ...


class _ConcatSource:
  """Documents of several sources one after another (the held-out set)."""

  def __init__(self, parts):
    self.parts = list(parts)
    self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getitem__(self, i) -> str:
    k = int(np.searchsorted(self.offsets, int(i), side="right")) - 1
    return self.parts[k][int(i) - int(self.offsets[k])]


@dataclasses.dataclass
class CurriculumData:
  """What the train loop needs for a curriculum run."""

  train: stages_lib.StagedIterator
  eval_batches: list  # held-out int32 [B_eval, T_eval] batches
  tokenizer: Tokenizer
  eval_at: frozenset  # global steps at which a stage ends (held-out eval there)
  # Held-out text batches at each stage's own length {seq_len: batches} (the same documents
  # packed per length), evaluated when that stage ends.
  stage_eval_batches: dict = dataclasses.field(default_factory=dict)


def retrieval_weight(fraction: float, comps: Sequence[stages_lib.Component], source, *,
                     long_upsample: int = 1, long_min_bytes: int = 0) -> float:
  """The mixing weight (per document) that makes `source`'s documents `fraction` of a stage's
  tokens next to `comps`: the mix draws documents, and a text document (a pydoc page, a whole
  package) is often many times a retrieval document's length, so a per-document share would
  leave retrieval a few percent of the tokens. w = f / (1 - f) * sum_k w_k E[len_k] / E[len_r]
  (lengths in bytes, after long-document upsampling)."""
  text = 0.0
  for c in comps:
    lengths = stages_lib.doc_lengths(c.source)
    ids = stages_lib.upsampled_indices(np.arange(len(lengths)), lengths,
                                       min_bytes=long_min_bytes, factor=long_upsample)
    text += c.weight * float(lengths[ids].mean())
  return fraction / (1 - fraction) * text / float(np.mean(source.lengths))


def stage_data(stages: Sequence[Stage], train_sources: dict[str, Any], *, seed: int,
               shard_count: int = 1) -> list[stages_lib.StageData]:
  """Per-stage pipeline inputs (batch per host); retrieval docs join as one more component."""
  out = []
  for s in stages:
    if s.batch_size % shard_count:
      raise ConfigError(f"config field `curriculum.stages[{s.index}].seq_len` = {s.seq_len} is "
                        f"invalid: its global batch {s.batch_size} must split evenly over "
                        f"{shard_count} hosts")
    comps = [stages_lib.Component(n, train_sources[n], w) for n, w in s.weights.items()]
    answer_weight = getattr(s, "retrieval_answer_weight", 1.0)
    if s.retrieval_fraction > 0:
      lo, hi = s.retrieval_bytes
      src = retrieval.RetrievalSource(hi, min_bytes=lo,
                                      seed=seed + 7919 * s.index, answer_weight=answer_weight,
                                      kinds=tuple(getattr(s, "retrieval_kinds",
                                                          retrieval.DEFAULT_KINDS)))
      comps.append(stages_lib.Component("retrieval", src, retrieval_weight(
          s.retrieval_fraction, comps, src, long_upsample=s.long_upsample,
          long_min_bytes=s.long_min_bytes)))
    out.append(stages_lib.StageData(
        index=s.index, seq_len=s.seq_len, batch_size=s.batch_size // shard_count,
        steps=s.steps, components=tuple(comps), long_upsample=s.long_upsample,
        long_min_bytes=s.long_min_bytes, seed=seed + 1009 * s.index,
        loss_weights=s.retrieval_fraction > 0 and answer_weight != 1.0))
  return out


def _split_sources(names, curriculum: CurriculumConfig, data: DataConfig, shard_count: int):
  """-> ({name: train source}, [held-out sources]); every bad source fails here."""
  train_sources, heldout = {}, []
  for name in names:
    spec = curriculum.sources[name]
    try:
      src = sources_lib.make_source(spec.kind, spec.paths, spec.field,
                                    data.bad_records)
    except ValueError as e:
      raise ValueError(f"curriculum source {name!r} ({spec.kind}): {e}") from e
    if len(src) < 2:
      raise ValueError(f"curriculum source {name!r} ({spec.kind}) yields {len(src)} "
                       "documents; it needs at least 2 (one is held out)")
    tr, ho = sources_lib.split_source(src, data.heldout_fraction, data.heldout_seed)
    if len(tr) < shard_count:
      raise ValueError(f"curriculum source {name!r} has {len(tr)} training documents, fewer "
                       f"than the {shard_count} input shards reading it")
    logging.info("curriculum source %s (%s): %d documents, %d train, %d held out", name,
                 spec.kind, len(src), len(tr), len(ho))
    train_sources[name], heldout = tr, heldout + [ho]
  return train_sources, heldout


def _host_stage(stage: stages_lib.StageData, *, shards: range, shard_count: int, **kw):
  """This process's batches of one stage (stage.batch_size rows): its input shards' pipelines
  (shard j of `shard_count`, stage.batch_size / len(shards) rows each) side by side."""
  rows = dataclasses.replace(stage, batch_size=stage.batch_size // len(shards))
  its = [stages_lib.make_stage_dataset(rows, shard_index=j, shard_count=shard_count, **kw)
         for j in shards]
  return its[0] if len(its) == 1 else pipeline_lib.ShardsIterator([iter(d) for d in its])


def heldout_rows(curriculum: CurriculumConfig, seq_len: int) -> int:
  """Rows per process of a held-out batch of `seq_len` tokens: the curriculum's tokens per
  step, at least one row."""
  return max(1, curriculum.tokens_per_step // seq_len)


def build_curriculum_data(stages: Sequence[Stage], curriculum: CurriculumConfig,
                          data: DataConfig, *, vocab_size: int, seed: int, eval_batches: int,
                          vision: VisionConfig | None = None, shard_index: int | None = None,
                          shard_count: int | None = None,
                          tokenizer: Tokenizer | None = None) -> CurriculumData:
  """Indexes every source the stages use (all bad input fails here), builds the iterator.

  Args:
    stages: the plan's resolved stages, in order.
    curriculum, data: the `curriculum` and `data` sections.
    vocab_size: the model's vocabulary (must hold every tokenizer id).
    seed: the run seed; eval_batches: held-out batches (train.eval_batches).
    vision: the model's tower; when enabled every stage mixes image-text documents
      (`data.vision`) in at the token share data.vision.share and the held-out batches add
      image-text rows at the evaluation length.
    shard_index, shard_count: this process and the number of processes (default: jax's);
      it reads input shards `pipeline.host_input_shards(data.input_shards, ...)` of every
      stage, side by side (as the `data` pipeline does).
    tokenizer: default `make_tokenizer(data.tokenizer, vision=...)`.

  Raises:
    ConfigError: a stage batch that does not split over the hosts. ValueError / OSError: a
      source with no usable documents, a missing path, a host shard without documents.
  """
  shard_index = jax.process_index() if shard_index is None else shard_index
  shard_count = jax.process_count() if shard_count is None else shard_count
  with_images = vision is not None and vision.enabled
  inputs = data.input_shards or shard_count    # input shards in all
  if with_images and inputs > 1:
    raise NotImplementedError("a curriculum with images on several hosts (or data.input_shards "
                              "> 1): the image-text pipeline has no host shard")
  tokenizer = tokenizer or make_tokenizer(data.tokenizer, vision=with_images)
  proc = (vlm_pipeline.processor_from_config(data, vision, vocab_size, tokenizer)
          if with_images else None)
  check_vocab(tokenizer, vocab_size)
  used = sorted({n for s in stages for n in s.weights})
  train_sources, heldout = _split_sources(used, curriculum, data, inputs)
  for name, src in train_sources.items():
    record_sources.check_tokenizer(src, tokenizer, fingerprint,
                                   f"curriculum source {name!r}")
  datas = stage_data(stages, train_sources, seed=seed, shard_count=shard_count)
  for d in datas:   # each stage's host batch must split over this process's input shards
    mine, _ = pipeline_lib.host_input_shards(data.input_shards, d.batch_size, shard_index,
                                             shard_count)
  eval_len = curriculum.eval_seq_len or stages[-1].seq_len
  eval_rows = heldout_rows(curriculum, eval_len)
  evals = pipeline_lib.eval_batches(_ConcatSource(heldout), tokenizer, eval_len, eval_rows,
                                    eval_batches)
  if with_images:
    train_img, held_img = vlm_pipeline.image_text_sources(data, vision)
    build = functools.partial(vlm_pipeline.vlm_stage_iterator, proc=proc,
                              image_source=train_img, share=data.vision.share)
    held = multimodal.VLMPackedIterator([held_img[i] for i in range(len(held_img))], proc,
                                        seq_len=eval_len, batch_size=eval_rows,
                                        drop_remainder=False)
    evals += list(itertools.islice(held, eval_batches))
    logging.info("curriculum with images: %s image-text documents at token share %.2f",
                 data.vision.source, data.vision.share)
  else:
    build = functools.partial(
        _host_stage, shards=mine, shard_count=inputs, tokenizer=tokenizer,
        num_packing_bins=curriculum.num_packing_bins, num_workers=curriculum.num_workers)
  it = stages_lib.StagedIterator(datas, build)
  at_len = {s.seq_len: pipeline_lib.eval_batches(
      _ConcatSource(heldout), tokenizer, s.seq_len, heldout_rows(curriculum, s.seq_len),
      eval_batches)
            for s in stages if s.seq_len != eval_len}
  return CurriculumData(it, evals, tokenizer, frozenset(s.end_step for s in stages[:-1]),
                        at_len)
