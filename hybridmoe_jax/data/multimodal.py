"""Interleaved image-text documents: processor (with per-token loss weights) and packing.

A document is text with one "<image>" marker per image. The processor turns it into
    BOS text <image_start> IMAGE_PAD x K <image_end> text ... EOS
with K = (h / 2p) * (w / 2p) placeholders for an image of h x w pixels (one per merged 2x2
patch block), plus the checked float32 pixels. Packing fills rows of T tokens with whole
documents (a document longer than a row is cut only between images, never inside one) and
up to M image slots. A batch pads every image to the smallest bucket side S in
`model.vision.image_buckets` that holds all of its images, so the step compiles once per
bucket, not once per image size. Batches:
    tokens, segment_ids, positions  int32 [B, T]   (as in packing.py)
    loss_weights float32 [B, T]            each token's weight as a target (0 on padding and
                                           image tokens; see Processor for answer spans)
    images       float32 [B, M, S, S, C]   (zeros in empty slots)
    image_grid   int32 [B, M, 2]           real patch rows, cols (0 for an empty slot)
    image_index  int32 [B, T]              -1 on text; m * K_S + r * S/2p + c on the
                                           placeholder of merged token (r, c) of slot m,
                                           K_S = (S/2p)^2 (see model/decoder.py)
The iterator's state is the (document index, offset) of the next batch's first row, so a
resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

from absl import logging
import numpy as np

from hybridmoe_jax.config import ConfigError, VisionConfig
from hybridmoe_jax.data import images as images_lib
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer, IMAGE_END_ID, IMAGE_START_ID
from hybridmoe_jax.config.run import VisionDataConfig

IMAGE_MARKER = images_lib.IMAGE_MARKER


# ------------------------------------------------------------------------------- processor


@dataclasses.dataclass
class Document:
  """A processed document: tokens int32 [n], per-token loss weights float32 [n] (the weight
  of each token as a next-token target) and per image the pixels and patch grid."""

  tokens: np.ndarray
  images: list          # float32 [h, w, C] each
  grids: list           # (h / p, w / p) each
  weights: np.ndarray | None = None  # float32 [n]; None = 1.0 everywhere
  # (image_start, image_end) ids of the tokenizer that made `tokens`.
  image_delims: tuple[int, int] = (IMAGE_START_ID, IMAGE_END_ID)

  def __post_init__(self):
    if self.weights is None:
      self.weights = np.ones(len(self.tokens), np.float32)

  def image_spans(self) -> list[tuple[int, int]]:
    """[start, end) token spans of each image, <image_start> .. <image_end> inclusive."""
    starts = np.flatnonzero(self.tokens == self.image_delims[0])
    ends = np.flatnonzero(self.tokens == self.image_delims[1])
    return [(int(a), int(b) + 1) for a, b in zip(starts, ends)]


def tokens_per_image(h: int, w: int, patch_size: int) -> int:
  """Merged image tokens (= placeholders) of an h x w image (sides multiples of 2p)."""
  return (h // (2 * patch_size)) * (w // (2 * patch_size))


class Processor:
  """(text with "<image>" markers, images) -> Document; see the module docstring.

  Loss weights: a document given `answer_spans` (character ranges of its text) is a prompt /
  answer document: text inside the spans weighs `answer_loss_weight` as a target, the rest
  `prompt_loss_weight` (data.vision.*_loss_weight); without spans every token weighs 1.
  Text is tokenized in runs of equal weight, so every token lies in one span (with the byte
  tokenizer this is the same as tokenizing the whole text).

  Args:
    vision: the model's VisionConfig (patch size, channels, largest bucket).
    tokenizer: a tokenizer with image roles (default: the byte tokenizer with vision).
    pad_images: pad sides to a multiple of 2p instead of rejecting the image.
    prompt_loss_weight: target weight of text outside the answer spans, in [0, 1].
    answer_loss_weight: target weight of text inside the answer spans, in (0, 100].
  """

  def __init__(self, vision: VisionConfig, *, pad_images: bool = False,
               prompt_loss_weight: float = 1.0, answer_loss_weight: float = 1.0,
               tokenizer: Tokenizer | None = None):
    if not vision.enabled:
      raise ConfigError("the image-text processor needs model.vision.enabled = True")
    VisionDataConfig(prompt_loss_weight=prompt_loss_weight,  # their ranges: data.vision's
                     answer_loss_weight=answer_loss_weight)
    tokenizer = tokenizer or ByteTokenizer(vision=True)
    if None in (tokenizer.image_start_id, tokenizer.image_end_id, tokenizer.image_pad_id):
      raise ConfigError(f"tokenizer {getattr(tokenizer, 'name', tokenizer)} has no image "
                        "tokens: build it with vision=True (make_tokenizer(spec, vision=True))")
    self.vision = vision
    self.pad_images = pad_images
    self.prompt_loss_weight = float(prompt_loss_weight)
    self.answer_loss_weight = float(answer_loss_weight)
    self.tokenizer = tokenizer

  def image(self, image) -> np.ndarray:
    v = self.vision
    return images_lib.prepare_image(image, patch_size=v.patch_size,
                                    num_channels=v.num_channels,
                                    max_side=v.image_buckets[-1], pad=self.pad_images)

  def __call__(self, text: str, images: Sequence[Any] = (), *, bos: bool = True,
               eos: bool = True, answer_spans: Sequence[tuple[int, int]] | None = None
               ) -> Document:
    """Raises ValueError when markers and images disagree in number or a span lies outside
    the text, ImageError on a bad image."""
    parts = text.split(IMAGE_MARKER)
    if len(parts) - 1 != len(images):
      raise ValueError(f"the text has {len(parts) - 1} {IMAGE_MARKER} marker(s) but "
                       f"{len(images)} image(s) were given: need one image per marker")
    char_w = None if answer_spans is None else self._char_weights(text, answer_spans)
    tok, p = self.tokenizer, self.vision.patch_size
    ids = [np.array([tok.bos_id], np.int32)] if bos else []
    wts = [np.ones(1, np.float32)] if bos else []
    pix, grids, at = [], [], 0
    for k, part in enumerate(parts):
      if char_w is None:
        ids.append(tok.encode(part))
        wts.append(np.ones(len(ids[-1]), np.float32))
      else:  # each run of equal character weight tokenized alone, its tokens of that weight
        w = char_w[at:at + len(part)]
        cuts = [0] + [i for i in range(1, len(part)) if w[i] != w[i - 1]] + [len(part)]
        for a, b in zip(cuts[:-1], cuts[1:]):
          if a < b:
            ids.append(tok.encode(part[a:b]))
            wts.append(np.full(len(ids[-1]), w[a], np.float32))
      at += len(part) + len(IMAGE_MARKER)
      if k < len(images):
        a = self.image(images[k])
        n = tokens_per_image(a.shape[0], a.shape[1], p)
        ids.append(np.array([tok.image_start_id] + [tok.image_pad_id] * n + [tok.image_end_id],
                            np.int32))
        wts.append(np.zeros(n + 2, np.float32))  # never targets (the step masks them too)
        pix.append(a)
        grids.append((a.shape[0] // p, a.shape[1] // p))
    if eos:
      ids.append(np.array([tok.eos_id], np.int32))
      wts.append(np.full(1, 1.0 if char_w is None else self.prompt_loss_weight, np.float32))
    return Document(np.concatenate(ids).astype(np.int32), pix, grids, np.concatenate(wts),
                    (tok.image_start_id, tok.image_end_id))

  def _char_weights(self, text: str, spans) -> np.ndarray:
    w = np.full(len(text), self.prompt_loss_weight, np.float32)
    for span in spans:
      a, b = (int(x) for x in span)
      if not 0 <= a <= b <= len(text):
        raise ValueError(f"answer span {tuple(span)} lies outside the document text of "
                         f"{len(text)} characters: need 0 <= start <= end <= {len(text)}")
      w[a:b] = self.answer_loss_weight
    return w


def pick_bucket(vision: VisionConfig, sides: Sequence[int]) -> int:
  """Smallest bucket side >= every side given (the largest bucket for no images)."""
  need = max(sides, default=0)
  for b in vision.image_buckets:
    if b >= need:
      return b
  raise images_lib.ImageError(f"image side {need} exceeds the largest bucket "
                              f"{vision.image_buckets[-1]} (model.vision.image_buckets)")


def collate(rows: list[dict], vision: VisionConfig, seq_len: int,
            bucket: int | None = None) -> dict[str, np.ndarray]:
  """Rows {"tokens", "segment_ids", "positions": [T], "images": [[h,w,C]...], "grids",
  "image_index_local": [T] (-1 or slot * 1e6 + k)} -> one batch (see the module docstring)."""
  p, m_slots, c = vision.patch_size, vision.max_images_per_row, vision.num_channels
  if bucket is None:
    bucket = pick_bucket(vision, [max(a.shape[:2]) for r in rows for a in r["images"]])
  b = len(rows)
  half = bucket // (2 * p)
  out = {k: np.stack([r[k] for r in rows]).astype(np.int32)
         for k in ("tokens", "segment_ids", "positions")}
  out["loss_weights"] = np.stack([r["loss_weights"] for r in rows]).astype(np.float32)
  imgs = np.zeros((b, m_slots, bucket, bucket, c), np.float32)
  grid = np.zeros((b, m_slots, 2), np.int32)
  index = np.full((b, seq_len), -1, np.int32)
  for i, r in enumerate(rows):
    for m, (a, g) in enumerate(zip(r["images"], r["grids"])):
      imgs[i, m, :a.shape[0], :a.shape[1]] = a
      grid[i, m] = g
    local = r["image_index_local"]
    sel = local >= 0
    slot, k = local[sel] // _SLOT, local[sel] % _SLOT
    w2 = grid[i, slot, 1] // 2
    index[i, sel] = slot * half * half + (k // w2) * half + k % w2
  out.update(images=imgs, image_grid=grid, image_index=index)
  return out


_SLOT = 1 << 20  # local image index = slot * _SLOT + k (k: raster index among real tokens)


def inference_batch(doc: Document, vision: VisionConfig) -> dict[str, np.ndarray]:
  """One processed document -> a batch of one row (T = its length, one segment)."""
  if len(doc.images) > vision.max_images_per_row:
    raise ValueError(f"{len(doc.images)} images > model.vision.max_images_per_row = "
                     f"{vision.max_images_per_row}")
  n = len(doc.tokens)
  row = _row_from_pieces([(doc, 0, n)], n, pad_id=0)  # one full row: nothing to pad
  return collate([row], vision, n)


# ------------------------------------------------------------------------------- packing


def _row_from_pieces(pieces: list[tuple[Document, int, int]], seq_len: int,
                     pad_id: int) -> dict:
  """Pieces (doc, start, end) -> one packed row with local image indices; the rest of the
  row holds `pad_id` (segment 0)."""
  tokens = np.full(seq_len, pad_id, np.int32)
  weights = np.zeros(seq_len, np.float32)
  seg = np.zeros(seq_len, np.int32)
  pos = np.zeros(seq_len, np.int32)
  local = np.full(seq_len, -1, np.int32)
  imgs, grids, at = [], [], 0
  for s, (doc, a, b) in enumerate(pieces, start=1):
    n = b - a
    tokens[at:at + n] = doc.tokens[a:b]
    weights[at:at + n] = doc.weights[a:b]
    seg[at:at + n] = s
    pos[at:at + n] = np.arange(n)
    for (sa, sb), img, g in zip(doc.image_spans(), doc.images, doc.grids):
      if a <= sa and sb <= b:
        slot = len(imgs)
        imgs.append(img)
        grids.append(g)
        local[at + sa - a + 1:at + sb - a - 1] = slot * _SLOT + np.arange(sb - sa - 2)
    at += n
  return {"tokens": tokens, "segment_ids": seg, "positions": pos, "loss_weights": weights,
          "images": imgs, "grids": grids, "image_index_local": local}


def _cut(doc: Document, start: int, room: int) -> int:
  """Largest end <= start + room that does not fall inside an image span."""
  end = min(len(doc.tokens), start + room)
  for a, b in doc.image_spans():
    if a < end < b:
      end = a
  return end


class VLMPackedIterator:
  """Checkpointable iterator of packed image-text batches over a random-access doc dataset.

  Greedy packing: whole documents go into the current row while they fit (and while image
  slots remain); a document that does not fit starts a new row; one longer than a row is cut
  into row-sized pieces between images. A document whose image span alone exceeds a row, or
  that fails to process (bad image, unreadable file), is skipped and counted
  (`self.skipped`).

  Args:
    docs: random-access dataset, docs[i] -> (text, [images]) or str (text only); may be
      infinite (a repeated grain MapDataset).
    processor: Processor of the model.
    seq_len, batch_size: T and B.
    num_docs: stop after this many documents (None: len(docs), which may be "infinite").
  """

  def __init__(self, docs, processor: Processor, *, seq_len: int, batch_size: int,
               num_docs: int | None = None, drop_remainder: bool = True):
    if min(seq_len, batch_size) < 1:
      raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
    self.docs, self.proc = docs, processor
    self.seq_len, self.batch_size = seq_len, batch_size
    self.num_docs = len(docs) if num_docs is None else num_docs
    self.drop_remainder = drop_remainder
    self.doc, self.offset = 0, 0
    self.skipped = collections.Counter()
    self._cache: tuple[int, Document | None] | None = None

  def get_state(self) -> dict[str, int]:
    return {"doc": self.doc, "offset": self.offset}

  def set_state(self, state: dict[str, int]) -> None:
    self.doc, self.offset = int(state["doc"]), int(state["offset"])

  def __iter__(self):
    return self

  def _load(self, i: int) -> Document | None:
    if self._cache is not None and self._cache[0] == i:
      return self._cache[1]
    item = self.docs[i]
    # str | (text, images) | (text, images, answer_spans): see Processor; None: unreadable.
    if item is None:
      item = ("", None)
    text, imgs, spans = (item, [], None) if isinstance(item, str) else (*item, None)[:3]
    doc = None
    try:
      if imgs is None:
        raise images_lib.ImageError("document or image file missing or unreadable")
      doc = self.proc(text, imgs, answer_spans=spans)
      if any(b - a > self.seq_len for a, b in doc.image_spans()):
        raise ValueError(f"an image needs more than seq_len = {self.seq_len} tokens")
      if len(doc.images) > self.proc.vision.max_images_per_row and len(doc.tokens) <= \
          self.seq_len:
        raise ValueError("more images than model.vision.max_images_per_row")
    except (ValueError, OSError) as e:
      reason = type(e).__name__
      if not self.skipped[reason]:
        logging.warning("skipping an image-text document (%s: %s); later ones are counted",
                        reason, str(e)[:200])
      self.skipped[reason] += 1
      doc = None
    self._cache = (i, doc)
    return doc

  def _next_row(self) -> dict | None:
    pieces, used, slots = [], 0, 0
    max_slots = self.proc.vision.max_images_per_row
    while self.doc < self.num_docs:
      doc = self._load(self.doc)
      if doc is None or len(doc.tokens) == 0:
        self.doc, self.offset = self.doc + 1, 0
        continue
      n = len(doc.tokens)
      room = self.seq_len - used
      if self.offset == 0 and n <= self.seq_len:
        if n > room or slots + len(doc.images) > max_slots:
          break  # a whole document that fits a fresh row never gets cut
        pieces.append((doc, 0, n))
        used, slots = used + n, slots + len(doc.images)
        self.doc += 1
        continue
      end = _cut(doc, self.offset, room)
      spans = [s for s in doc.image_spans() if self.offset <= s[0] and s[1] <= end]
      while spans and slots + len(spans) > max_slots:  # too many images for this row
        end = spans.pop()[0]
      if end <= self.offset:
        if not pieces:  # cannot happen: every image fits a fresh row; guard anyway
          self.doc, self.offset = self.doc + 1, 0
          continue
        break
      pieces.append((doc, self.offset, end))
      used, slots = used + end - self.offset, slots + len(spans)
      self.doc, self.offset = (self.doc + 1, 0) if end == n else (self.doc, end)
      if used == self.seq_len:
        break
    return (_row_from_pieces(pieces, self.seq_len, self.proc.tokenizer.pad_id) if pieces
            else None)

  def __next__(self) -> dict[str, np.ndarray]:
    rows = []
    while len(rows) < self.batch_size:
      row = self._next_row()
      if row is None:
        break
      rows.append(row)
    if not rows or (self.drop_remainder and len(rows) < self.batch_size):
      raise StopIteration
    while len(rows) < self.batch_size:  # padding rows (segment id 0) for a static shape
      rows.append(_row_from_pieces([], self.seq_len, self.proc.tokenizer.pad_id))
    return collate(rows, self.proc.vision, self.seq_len)
