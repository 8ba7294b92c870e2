"""The image-text data pipeline of a vision model: `config.data.vision`, its checks, mixing
with text by token share, and the train / held-out / curriculum-stage iterators.

Documents, the processor and the packer live in `hybridmoe_jax.data.multimodal`.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from absl import logging
import grain
import ml_collections
import numpy as np

from hybridmoe_jax.config import VisionConfig
from hybridmoe_jax.data import images as images_lib
from hybridmoe_jax.data import tokenizer as tokenizer_lib
from hybridmoe_jax.data.image_text_source import ImageJsonlSource
from hybridmoe_jax.data.multimodal import (VISION_SOURCES, Processor, VLMPackedIterator,
                                           check_loss_weights, require_field)


def default_vision_data_config() -> ml_collections.ConfigDict:
  """The `config.data.vision` section (used only when model.vision.enabled)."""
  c = ml_collections.ConfigDict()
  # Share of training tokens from image-text documents (the rest: the text source), (0, 1].
  c.share = 0.5
  # "synthetic" (bundled generated digit scenes with Q/A) or "jsonl" (image path + text).
  c.source = "synthetic"
  # JSONL files or directories for source = "jsonl".
  c.paths = ()
  # Generated documents per epoch (synthetic) and generated held-out documents.
  c.num_train = 200000
  c.num_heldout = 64
  # Image sides of generated scenes (pixels; multiples of 2 * patch_size).
  c.sides = (28, 56)
  # Seeds of the generated train and held-out scenes (disjoint by seed).
  c.train_seed = 1
  c.heldout_seed = 2
  # Pad images whose sides are not multiples of 2 * patch_size (else they are rejected).
  c.pad_images = False
  # Target weights in documents that mark answer spans (the synthetic Q/A documents; JSONL
  # records with "answer_spans"): prompt text in [0, 1], answers in (0, 100]; every other
  # token (text documents, captions) weighs 1. Standard prompt masking is (0, 1); tiny_vlm
  # also weighs answers up (see configs/tiny_vlm.py).
  c.prompt_loss_weight = 0.0
  c.answer_loss_weight = 1.0
  # Synthetic Q/A documents: relative sampling weight of each question type (> 0).
  c.question_weights = dict(images_lib.QA_WEIGHTS)
  return c


def validate_vision_data_config(c: ml_collections.ConfigDict, vision: VisionConfig) -> None:
  """Checks `config.data.vision` against the model's vision config (ConfigError)."""
  require_field(isinstance(c.share, (int, float)) and 0.0 < c.share <= 1.0, "share", c.share,
       "a number in (0, 1]")
  require_field(c.source in VISION_SOURCES, "source", c.source, f"one of {VISION_SOURCES}")
  require_field(isinstance(c.paths, (tuple, list)) and all(isinstance(p, str) and p for p in c.paths),
       "paths", c.paths, "a tuple of non-empty path strings")
  if c.source == "jsonl":
    require_field(len(c.paths) > 0, "paths", c.paths, "at least one path when source = 'jsonl'")
  for name in ("num_train", "num_heldout"):
    require_field(isinstance(c[name], int) and c[name] >= 1, name, c[name], "an integer >= 1")
  m, top = 2 * vision.patch_size, vision.image_buckets[-1]
  require_field(len(c.sides) > 0 and all(isinstance(s, int) and s > 0 and s % m == 0 and s <= top
                                for s in c.sides), "sides", c.sides,
       f"positive multiples of 2 * patch_size = {m}, at most the largest bucket {top}")
  require_field(isinstance(c.pad_images, bool), "pad_images", c.pad_images, "True or False")
  check_loss_weights(c.prompt_loss_weight, c.answer_loss_weight)
  qw = dict(c.question_weights)
  require_field(sorted(qw) == sorted(images_lib.QUESTION_TYPES)
       and all(isinstance(w, (int, float)) and w > 0 for w in qw.values()),
       "question_weights", qw, f"a weight > 0 for each of {images_lib.QUESTION_TYPES}")


@dataclasses.dataclass(frozen=True)
class VLMData:
  """What the train loop needs (same fields the text TrainEvalData offers the loop)."""

  train: VLMPackedIterator
  eval_batches: list
  tokenizer: tokenizer_lib.ByteTokenizer
  train_source: Any
  heldout_source: Any


def _text_doc(text: str | None):
  """A text document in the packer's (text, images) form; None (unreadable) stays None."""
  return None if text is None else (text, [])


def _mean_tokens(proc: Processor, docs) -> float:
  """Mean processed length of the documents that process (1 if none do)."""
  lengths = []
  for doc in docs:
    if doc is None:
      continue
    text, imgs, *_ = doc
    try:
      lengths.append(len(proc(text, imgs or []).tokens))
    except (ValueError, OSError):
      continue
  return float(np.mean(lengths)) if lengths else 1.0


def token_share_mix(proc: Processor, image_docs: grain.MapDataset,
                    texts: Sequence[tuple[grain.MapDataset, float]], share: float,
                    sample: int = 64) -> tuple[grain.MapDataset, list[float]]:
  """Image-text documents mixed with text documents by TOKEN share.

  Image-text documents make `share` of the tokens and text dataset k (of str) makes
  (1 - share) * w_k / sum(w): each dataset is drawn with weight (its token share) / (its
  mean processed length over its first `sample` documents), so a few long text documents do
  not crowd out many short image-text ones. Datasets must be random access and infinite.
  Returns the mixture and its per-dataset draw weights (image-text first).
  """
  if share >= 1.0 or not texts:
    return image_docs, [1.0]
  parts = [image_docs] + [ds.map(_text_doc) for ds, _ in texts]
  shares = [share] + [(1.0 - share) * w / sum(w for _, w in texts) for _, w in texts]
  weights = [sh / _mean_tokens(proc, [ds[i] for i in range(sample)])
             for ds, sh in zip(parts, shares)]
  return grain.MapDataset.mix(parts, weights), weights


def vlm_stage_iterator(stage, *, proc: Processor, image_source, share: float
                       ) -> VLMPackedIterator:
  """One curriculum stage (`data.stages.StageData`) as packed image-text batches.

  The stage's text components keep their weights, long-document upsampling and retrieval
  share among the text tokens; image-text documents from `image_source` make `share` of all
  tokens. Rows of stage.seq_len, stage.batch_size rows, resumable like any VLMPackedIterator.
  One host only (the image-text pipeline has no host shard).
  """
  # pylint: disable=g-import-not-at-top  (avoid a cycle through data/__init__)
  from hybridmoe_jax.data import stages as stages_lib
  img = grain.MapDataset.source(image_source).shuffle(stage.seed).repeat(None)
  texts = [(stages_lib.component_docs(c, seed=stage.seed + k + 1,
                                      long_upsample=stage.long_upsample,
                                      long_min_bytes=stage.long_min_bytes), c.weight)
           for k, c in enumerate(stage.components)]
  ds, _ = token_share_mix(proc, img, texts, share)
  return VLMPackedIterator(ds, proc, seq_len=stage.seq_len, batch_size=stage.batch_size,
                           num_docs=1 << 62)


def image_text_sources(data_cfg: ml_collections.ConfigDict, vision: VisionConfig):
  """-> (train, held-out) image-text sources of `data.vision` (generated or JSONL)."""
  # pylint: disable=g-import-not-at-top  (avoid a cycle through data/__init__)
  from hybridmoe_jax.data import sources as sources_lib
  vc = data_cfg.vision
  if vc.source == "synthetic":
    kw = dict(sides=tuple(vc.sides), channels=vision.num_channels,
              question_weights=dict(vc.question_weights))
    return (images_lib.SyntheticVQASource(vc.num_train, seed=vc.train_seed, **kw),
            images_lib.SyntheticVQASource(vc.num_heldout, seed=vc.heldout_seed, **kw))
  return sources_lib.split_source(ImageJsonlSource(list(vc.paths)), data_cfg.heldout_fraction,
                                  data_cfg.heldout_seed)


def processor_from_config(data_cfg: ml_collections.ConfigDict, vision: VisionConfig,
                          vocab_size: int) -> Processor:
  """Checks `data.vision` and the vocabulary; the processor it configures."""
  vc = data_cfg.vision
  validate_vision_data_config(vc, vision)
  tokenizer_lib.check_vocab(tokenizer_lib.ByteTokenizer(vision=True), vocab_size)
  return Processor(vision, pad_images=vc.pad_images,
                   prompt_loss_weight=float(vc.prompt_loss_weight),
                   answer_loss_weight=float(vc.answer_loss_weight))


def build_vlm_train_and_eval(data_cfg: ml_collections.ConfigDict, vision: VisionConfig, *,
                             vocab_size: int, seq_len: int, batch_size: int, seed: int,
                             eval_batch_size: int | None = None,
                             max_eval_batches: int = 8) -> VLMData:
  """Image-text documents mixed with text at `data.vision.share`, packed into VLM batches.

  Raises ConfigError / ValueError / FileNotFoundError before any batch is built.
  """
  # pylint: disable=g-import-not-at-top  (avoid a cycle through data/__init__)
  from hybridmoe_jax.data import config as data_config
  from hybridmoe_jax.data import sources as sources_lib
  vc = data_cfg.vision
  proc = processor_from_config(data_cfg, vision, vocab_size)
  train_img, held_img = image_text_sources(data_cfg, vision)
  share = float(vc.share)
  img_ds = grain.MapDataset.source(train_img)
  img_ds = (img_ds.shuffle(seed) if data_cfg.shuffle else img_ds).repeat(None)
  held_docs = [held_img[i] for i in range(len(held_img))]
  if share < 1.0:
    text = data_config.source_from_config(data_cfg)
    text_train, text_held = sources_lib.split_source(text, data_cfg.heldout_fraction,
                                                     data_cfg.heldout_seed)
    txt_ds = grain.MapDataset.source(text_train)
    txt_ds = (txt_ds.shuffle(seed + 1) if data_cfg.shuffle else txt_ds).repeat(None)
    ds, (w_img, w_txt) = token_share_mix(proc, img_ds, [(txt_ds, 1.0)], share)
    # Held-out text in the same token proportion as training.
    n_text = max(1, round(len(held_docs) * w_txt / w_img))
    held_docs += [(text_held[i], []) for i in range(min(len(text_held), n_text))]
  else:
    ds = img_ds
  logging.info("vision data: %s image-text (%d train, %d held out) at share %.2f",
               vc.source, len(train_img), len(held_img), share)
  it = VLMPackedIterator(ds, proc, seq_len=seq_len, batch_size=batch_size,
                         num_docs=1 << 62)
  held_it = VLMPackedIterator(held_docs, proc, seq_len=seq_len,
                              batch_size=eval_batch_size or batch_size, drop_remainder=False)
  evals = list(itertools.islice(held_it, max_eval_batches))
  if not evals:
    raise ValueError("no held-out image-text batch could be built")
  return VLMData(it, evals, proc.tokenizer, train_img, held_img)
