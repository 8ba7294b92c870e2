"""`ImageJsonlSource`: user image-text documents from JSONL files (image paths + text)."""

from __future__ import annotations

import collections
import json
import os
import pathlib
from typing import Sequence

from absl import logging

from hybridmoe_jax.data import images as images_lib
from hybridmoe_jax.data.images import IMAGE_MARKER


class ImageJsonlSource:
  """User image-text data: JSONL lines {"image": path | "images": [paths], "text": str} with
  optionally "answer_spans": [[start, end], ...], character ranges of "text" that carry the
  full loss (the rest weighs data.vision.prompt_loss_weight; see multimodal.Processor).

  Relative image paths are resolved against the JSONL file's directory. Image files are
  .npy, .ppm or .pgm. If the text has no "<image>" marker the images are put before it.
  Lines that are not valid JSON or lack the fields, and lines whose image files do not exist,
  are skipped with one counted warning per file; an image file that exists but cannot be
  decoded is found when read: source[i] then returns (text, None) and the packer counts
  and skips it. Never raises mid-run.
  """

  def __init__(self, paths: Sequence[str], *, text_field: str = "text"):
    files = []
    for p in paths:
      p = pathlib.Path(p).expanduser()
      if p.is_dir():
        files += sorted(x for x in p.rglob("*.jsonl") if x.is_file())
      elif p.is_file():
        files.append(p)
      else:
        raise FileNotFoundError(f"image-text JSONL path {str(p)!r} does not exist")
    self.records: list[tuple[str, tuple[str, ...], tuple | None]] = []
    self.skipped = collections.Counter()
    for f in files:
      skipped = collections.Counter()
      with open(f, encoding="utf-8", errors="replace") as fh:
        for line in fh:
          if not line.strip():
            continue
          try:
            rec = json.loads(line)
            text = rec[text_field]
            imgs = rec.get("images", [rec["image"]] if "image" in rec else [])
            if (not isinstance(text, str) or not isinstance(imgs, list) or not imgs
                or not all(isinstance(i, str) for i in imgs)):
              raise KeyError
            spans = _spans(rec.get("answer_spans"), len(text))
          # ValueError: besides JSONDecodeError, an integer of over 4300 digits.
          except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
            skipped["malformed line"] += 1
            continue
          full = tuple(str(f.parent / i) if not os.path.isabs(i) else i for i in imgs)
          if not all(os.path.isfile(i) for i in full):
            skipped["missing image file"] += 1
            continue
          if IMAGE_MARKER not in text:
            prefix = IMAGE_MARKER * len(full) + "\n"
            text = prefix + text
            spans = spans and tuple((a + len(prefix), b + len(prefix)) for a, b in spans)
          self.records.append((text, full, spans))
      if skipped:
        logging.warning("%s: skipped %d lines (%s)", f, sum(skipped.values()),
                        ", ".join(f"{n} {r}" for r, n in sorted(skipped.items())))
      self.skipped.update(skipped)
    if not self.records:
      raise ValueError(f"no usable image-text records in {list(map(str, paths))} "
                       f"(skipped: {dict(self.skipped)})")

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, i):
    text, paths, spans = self.records[int(i)]
    try:
      imgs = [images_lib.read_image(p) for p in paths]
    except (ValueError, OSError):
      imgs = None
    return (text, imgs) if spans is None else (text, imgs, spans)


def _spans(value, n: int) -> tuple[tuple[int, int], ...] | None:
  """A record's "answer_spans" -> ((start, end), ...) inside [0, n]; KeyError if malformed."""
  if value is None:
    return None
  try:
    spans = tuple((int(a), int(b)) for a, b in value)
  except (TypeError, ValueError):
    raise KeyError("answer_spans") from None
  if not all(0 <= a <= b <= n for a, b in spans):
    raise KeyError("answer_spans")
  return spans
