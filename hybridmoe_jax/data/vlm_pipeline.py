"""The image-text data pipeline of a vision model (`data.vision`, a `VisionDataConfig`):
mixing with text by token share, and the train / held-out / curriculum-stage iterators.

Documents, the processor and the packer live in `hybridmoe_jax.data.multimodal`.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from absl import logging
import grain
import numpy as np

from hybridmoe_jax.config import VisionConfig
from hybridmoe_jax.data import images as images_lib
from hybridmoe_jax.data import pipeline as pipeline_lib
from hybridmoe_jax.data import sources as sources_lib
from hybridmoe_jax.data import stages as stages_lib
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers.load import check_vocab, make_tokenizer
from hybridmoe_jax.data.image_text_source import ImageJsonlSource
from hybridmoe_jax.data.multimodal import Processor, VLMPackedIterator
from hybridmoe_jax.config.run import DataConfig


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
  img = grain.MapDataset.source(image_source).shuffle(stage.seed).repeat(None)
  texts = [(stages_lib.component_docs(c, seed=stage.seed + k + 1,
                                      long_upsample=stage.long_upsample,
                                      long_min_bytes=stage.long_min_bytes), c.weight)
           for k, c in enumerate(stage.components)]
  ds, _ = token_share_mix(proc, img, texts, share)
  return VLMPackedIterator(ds, proc, seq_len=stage.seq_len, batch_size=stage.batch_size,
                           num_docs=1 << 62)


def image_text_sources(data_cfg: DataConfig, vision: VisionConfig):
  """-> (train, held-out) image-text sources of `data.vision` (generated or JSONL)."""
  vc = data_cfg.vision
  if vc.source == "synthetic":
    kw = dict(sides=tuple(vc.sides), channels=vision.num_channels,
              question_weights=dict(vc.question_weights))
    return (images_lib.SyntheticVQASource(vc.num_train, seed=vc.train_seed, **kw),
            images_lib.SyntheticVQASource(vc.num_heldout, seed=vc.heldout_seed, **kw))
  return sources_lib.split_source(ImageJsonlSource(list(vc.paths)), data_cfg.heldout_fraction,
                                  data_cfg.heldout_seed)


def processor_from_config(data_cfg: DataConfig, vision: VisionConfig, vocab_size: int,
                          tokenizer: Tokenizer | None = None) -> Processor:
  """Checks `data.vision` against the tower and the vocabulary; the processor it configures.

  tokenizer: one with image roles; default `make_tokenizer(data.tokenizer, vision=True)`.
  """
  vc = data_cfg.vision
  vc.check_against(vision)
  tokenizer = tokenizer or make_tokenizer(data_cfg.tokenizer, vision=True)
  check_vocab(tokenizer, vocab_size)
  return Processor(vision, tokenizer=tokenizer, pad_images=vc.pad_images,
                   prompt_loss_weight=float(vc.prompt_loss_weight),
                   answer_loss_weight=float(vc.answer_loss_weight))


def build_vlm_train_and_eval(data_cfg: DataConfig, vision: VisionConfig, *,
                             vocab_size: int, seq_len: int, batch_size: int, seed: int,
                             eval_batch_size: int | None = None,
                             max_eval_batches: int = 8,
                             tokenizer: Tokenizer | None = None) -> pipeline_lib.TrainEvalData:
  """Image-text documents mixed with text at `data.vision.share`, packed into VLM batches.

  tokenizer: one with image roles (default from `data.tokenizer`). Raises ConfigError /
  ValueError / FileNotFoundError before any batch is built.
  """
  vc = data_cfg.vision
  proc = processor_from_config(data_cfg, vision, vocab_size, tokenizer)
  train_img, held_img = image_text_sources(data_cfg, vision)
  share = float(vc.share)
  img_ds = grain.MapDataset.source(train_img)
  img_ds = (img_ds.shuffle(seed) if data_cfg.shuffle else img_ds).repeat(None)
  held_docs = [held_img[i] for i in range(len(held_img))]
  if share < 1.0:
    text = sources_lib.source_from_config(data_cfg)
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
  return pipeline_lib.TrainEvalData(it, evals, proc.tokenizer, train_img, held_img)
