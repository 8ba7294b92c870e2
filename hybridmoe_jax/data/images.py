"""Images for the vision path: checks, file readers (.npy, PPM/PGM) and a synthetic VQA set.

Pixel arrays are [H, W, C] uint8 (0..255) or float in [0, 1]; `prepare_image` turns one into
float32 [H', W', C] in [0, 1] with H', W' multiples of 2p (padding with black on the bottom
and right when asked, otherwise rejecting). No PIL: PPM (P3/P6) and PGM (P2/P5) are parsed
here, .npy through numpy.

The synthetic set draws exactly checkable content: a square image split into 2x2 cells, each
either empty (black) or holding one digit glyph (a 3x5 bitmap font defined below) in one of
four colours. Every image comes with its ground truth, a caption and question/answer pairs
of three types: count ("how many digits?"), where ("digit at top left?") and colour
("colour at top left?"). The phrasing is short on purpose: tokens per answer decide how fast
a tiny model learns to read the image. Image i of a seed is a pure function of
(seed, i), so train and held-out sets are reproducible and disjoint by seed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np

from hybridmoe_jax.config.run import QA_WEIGHTS, QUESTION_TYPES

# Where an image goes in a document's text (one marker per image).
IMAGE_MARKER = "<image>"

# 3x5 digit glyphs, one string of 5 rows x 3 columns each ("#" = ink).
_FONT = {
    0: ("###", "#.#", "#.#", "#.#", "###"),
    1: (".#.", "##.", ".#.", ".#.", "###"),
    2: ("###", "..#", "###", "#..", "###"),
    3: ("###", "..#", ".##", "..#", "###"),
    4: ("#.#", "#.#", "###", "..#", "..#"),
    5: ("###", "#..", "###", "..#", "###"),
    6: ("###", "#..", "###", "#.#", "###"),
    7: ("###", "..#", ".#.", ".#.", ".#."),
    8: ("###", "#.#", "###", "#.#", "###"),
    9: ("###", "#.#", "###", "..#", "###"),
}
GLYPHS = {d: np.array([[c == "#" for c in row] for row in rows], bool)
          for d, rows in _FONT.items()}
COLOURS = {"red": (255, 40, 40), "green": (40, 220, 40), "blue": (60, 90, 255),
           "yellow": (240, 230, 40)}
CELL_NAMES = ("top left", "top right", "bottom left", "bottom right")
# Question types and their default relative sampling weights live with the `data.vision`
# config section that sets them (run_config.py).
QA_PER_DOC = 4  # questions per Q/A training document


class ImageError(ValueError):
  """An image has the wrong shape, channel count, dtype, size or file format."""


def prepare_image(image, *, patch_size: int, num_channels: int, max_side: int,
                  pad: bool = False) -> np.ndarray:
  """Checks one image and returns float32 [H', W', C] in [0, 1], H', W' multiples of 2p.

  Args:
    image: [H, W, C] or [H, W] (grey, C = 1) array, uint8 or float in [0, 1].
    patch_size: p; sides must be multiples of 2p (the 2x2 merge needs an even patch grid).
    num_channels: C the tower expects (1 or 3).
    max_side: the largest bucket side; a larger image is rejected.
    pad: pad sides up to the next multiple of 2p with black instead of rejecting.

  Raises:
    ImageError naming the problem and the allowed values.
  """
  a = np.asarray(image)
  if a.ndim == 2:
    a = a[..., None]
  if a.ndim != 3:
    raise ImageError(f"an image must be [H, W, C] or [H, W]; got shape {a.shape}")
  if a.shape[2] != num_channels:
    raise ImageError(f"image has {a.shape[2]} channels, the vision tower expects "
                     f"model.vision.num_channels = {num_channels}")
  if a.dtype == np.uint8:
    a = a.astype(np.float32) / 255.0
  elif a.dtype in (np.float32, np.float64, np.float16):
    a = a.astype(np.float32)
    if not np.all(np.isfinite(a)) or a.min(initial=0.0) < 0.0 or a.max(initial=0.0) > 1.0:
      raise ImageError("a float image must hold finite values in [0, 1]")
  else:
    raise ImageError(f"image dtype {a.dtype} is not supported: use uint8 (0..255) or float "
                     "in [0, 1]")
  h, w = a.shape[:2]
  m = 2 * patch_size
  if h < 1 or w < 1:
    raise ImageError(f"image of size {h}x{w} is empty")
  if h % m or w % m:
    if not pad:
      raise ImageError(f"image of size {h}x{w} is not a multiple of 2 * patch_size = {m} on "
                       "each side: resize it, or enable padding (data.vision.pad_images / "
                       "--pad_image) to pad it with black")
    a = np.pad(a, ((0, -h % m), (0, -w % m), (0, 0)))
  if max(a.shape[:2]) > max_side:
    raise ImageError(f"image of size {a.shape[0]}x{a.shape[1]} exceeds the largest bucket "
                     f"side {max_side} (model.vision.image_buckets)")
  return a


# ----------------------------------------------------------------------------- file readers


def _pnm_tokens(data: bytes, count: int, start: int) -> tuple[list[bytes], int]:
  """The first `count` whitespace-separated header fields (comments skipped) from `start`."""
  out, i = [], start
  while len(out) < count:
    while i < len(data) and data[i:i + 1].isspace():
      i += 1
    if i < len(data) and data[i:i + 1] == b"#":
      while i < len(data) and data[i:i + 1] not in (b"\n", b"\r"):
        i += 1
      continue
    j = i
    while j < len(data) and not data[j:j + 1].isspace():
      j += 1
    if j == i:
      raise ImageError("truncated PNM header")
    out.append(data[i:j])
    i = j
  return out, i


def read_pnm(path: str) -> np.ndarray:
  """PPM (P3/P6) -> uint8 [H, W, 3]; PGM (P2/P5) -> uint8 [H, W, 1]. Maxval up to 65535."""
  with open(path, "rb") as f:
    data = f.read()
  magic = data[:2]
  if magic not in (b"P2", b"P3", b"P5", b"P6"):
    raise ImageError(f"{path}: not a PPM/PGM file (magic {magic!r})")
  fields, i = _pnm_tokens(data, 3, 2)
  try:
    w, h, maxval = (int(x) for x in fields)
  except ValueError:
    raise ImageError(f"{path}: bad PNM header {fields}") from None
  if w < 1 or h < 1 or not 1 <= maxval <= 65535:
    raise ImageError(f"{path}: bad PNM header width={w} height={h} maxval={maxval}")
  c = 3 if magic in (b"P3", b"P6") else 1
  n = w * h * c
  if magic in (b"P5", b"P6"):
    dt = np.dtype(">u2") if maxval > 255 else np.dtype(np.uint8)
    raw = data[i + 1:i + 1 + n * dt.itemsize]
    if len(raw) != n * dt.itemsize:
      raise ImageError(f"{path}: truncated pixel data ({len(raw)} of {n * dt.itemsize} bytes)")
    px = np.frombuffer(raw, dt).astype(np.int64)
  else:
    vals = data[i:].split()
    if len(vals) < n:
      raise ImageError(f"{path}: truncated pixel data ({len(vals)} of {n} values)")
    try:
      px = np.array([int(v) for v in vals[:n]], np.int64)
    except ValueError:
      raise ImageError(f"{path}: non-numeric pixel data") from None
  if px.size and px.max() > maxval:
    raise ImageError(f"{path}: pixel value {px.max()} > maxval {maxval}")
  px = np.round(px * (255.0 / maxval)).astype(np.uint8)
  return px.reshape(h, w, c)


def write_pnm(path: str, image: np.ndarray) -> None:
  """uint8 [H, W, 3] -> binary PPM (P6); [H, W] or [H, W, 1] -> binary PGM (P5)."""
  a = np.asarray(image)
  if a.dtype != np.uint8:
    raise ImageError(f"write_pnm needs uint8 pixels, got {a.dtype}")
  if a.ndim == 3 and a.shape[2] == 1:
    a = a[..., 0]
  magic = b"P6" if a.ndim == 3 else b"P5"
  with open(path, "wb") as f:
    f.write(magic + f"\n{a.shape[1]} {a.shape[0]}\n255\n".encode() + a.tobytes())


def read_image(path: str) -> np.ndarray:
  """.npy (any [H, W(, C)] array) or .ppm/.pgm/.pnm; ImageError / OSError when unreadable."""
  ext = os.path.splitext(path)[1].lower()
  if ext == ".npy":
    try:
      return np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as e:  # EOFError: an empty file
      raise ImageError(f"{path}: unreadable .npy ({e})") from None
  if ext in (".ppm", ".pgm", ".pnm"):
    return read_pnm(path)
  raise ImageError(f"{path}: unsupported image format {ext!r}: use .npy, .ppm or .pgm")


# ------------------------------------------------------------------------- synthetic images


@dataclasses.dataclass(frozen=True)
class SceneTruth:
  """Ground truth of one synthetic image: per cell (CELL_NAMES order) a digit or None and
  its colour name or None."""

  side: int
  digits: tuple
  colours: tuple

  @property
  def count(self) -> int:
    return sum(d is not None for d in self.digits)


def glyph_scale(cell: int) -> int:
  """Integer scale of the 3x5 glyph in a cell of `cell` pixels: the largest that leaves the
  glyph's 5 * scale rows inside the cell with at least one pixel to spare (1 for cells under
  11 pixels; 3 for 16). Big strokes make digit identity a large, easily read pixel feature."""
  return max(1, (cell - 1) // 5)


def render_scene(truth: SceneTruth, channels: int = 3) -> np.ndarray:
  """-> uint8 [side, side, channels]: each non-empty cell holds its glyph, centred, scaled by
  glyph_scale(cell) (grey images use the colour's mean intensity)."""
  s = truth.side
  cell = s // 2
  img = np.zeros((s, s, 3), np.uint8)
  scale = glyph_scale(cell)
  gh, gw = 5 * scale, 3 * scale
  for k, (d, col) in enumerate(zip(truth.digits, truth.colours)):
    if d is None:
      continue
    glyph = np.kron(GLYPHS[d], np.ones((scale, scale), bool))
    y0 = (k // 2) * cell + (cell - gh) // 2
    x0 = (k % 2) * cell + (cell - gw) // 2
    img[y0:y0 + gh, x0:x0 + gw][glyph] = COLOURS[col]
  if channels == 1:
    return np.round(img.mean(axis=2, keepdims=True)).astype(np.uint8)
  return img


def random_scene(rng: np.random.Generator, sides: Sequence[int]) -> SceneTruth:
  """1..4 non-empty cells, digits and colours uniform (so each answer class is balanced)."""
  side = int(rng.choice(list(sides)))
  n = int(rng.integers(1, 5))
  filled = set(rng.choice(4, size=n, replace=False).tolist())
  names = list(COLOURS)
  digits = tuple(int(rng.integers(10)) if k in filled else None for k in range(4))
  colours = tuple(names[int(rng.integers(len(names)))] if k in filled else None
                  for k in range(4))
  return SceneTruth(side, digits, colours)


def questions(truth: SceneTruth) -> list[tuple[str, str, str]]:
  """Every (type, question, answer) about `truth`; position questions only for filled cells."""
  out = [("count", "how many digits?", str(truth.count))]
  for name, d, col in zip(CELL_NAMES, truth.digits, truth.colours):
    if d is not None:
      out.append(("where", f"digit at {name}?", str(d)))
      out.append(("colour", f"colour at {name}?", col))
  return out


def caption(truth: SceneTruth) -> str:
  parts = [f"{name} {'empty' if d is None else f'{col} {d}'}"
           for name, d, col in zip(CELL_NAMES, truth.digits, truth.colours)]
  return ", ".join(parts) + "."


def vqa_text(question: str, answer: str | None = None) -> str:
  """Question first, then the image, then the answer: "Q: <q>\n<image>\nA: <a>\n".

  With the question before the image, a causal decoder reads each image token already
  knowing what is asked (the KDA state carries the question), so it can write just the
  asked quadrant into its state; with the image first it must look the quadrant up later.
  """
  return f"Q: {question}\n<image>\nA:" + ("" if answer is None else f" {answer}\n")


class SyntheticVQASource:
  """Random-access image-text documents: source[i] -> (text with "<image>", [uint8 image])
  for a caption document, (text, [image] * n, answer_spans) for a Q/A document.

  Each document: with probability 0.2 the image and its caption; otherwise QA_PER_DOC of the
  scene's questions (drawn with `question_weights` per type, default QA_WEIGHTS), each as
  "Q: <q>\n<image>\nA: <a>\n" (see vqa_text), with the character spans of the answers
  (" <a>\n") so that the processor can weigh the question text down
  (data.vision.prompt_loss_weight).

  Args:
    num_docs: length (documents are generated on demand; nothing is stored).
    seed: documents are pure functions of (seed, index).
    sides: image sides to draw from (pixels; multiples of 2p for the target model).
    channels: 3 (RGB) or 1 (grey).
    question_weights: {question type: relative sampling weight > 0} (QUESTION_TYPES).
  """

  def __init__(self, num_docs: int, *, seed: int, sides: Sequence[int], channels: int = 3,
               question_weights: dict[str, float] | None = None):
    if num_docs < 1:
      raise ValueError(f"num_docs must be >= 1, got {num_docs}")
    self.num_docs, self.seed, self.sides, self.channels = num_docs, seed, tuple(sides), channels
    if not self.sides or min(self.sides) < 10:  # render_scene fails on smaller cells
      raise ValueError(f"sides must be >= 10 pixels (each of the 2x2 cells holds a glyph 5 "
                       f"pixels tall), got {self.sides}")
    self.question_weights = dict(QA_WEIGHTS if question_weights is None else question_weights)
    if (sorted(self.question_weights) != sorted(QUESTION_TYPES)
        or not all(w > 0 for w in self.question_weights.values())):
      raise ValueError(f"question_weights must give each of {QUESTION_TYPES} a weight > 0, "
                       f"got {self.question_weights}")

  def __len__(self) -> int:
    return self.num_docs

  def truth(self, i: int) -> SceneTruth:
    return random_scene(np.random.default_rng([self.seed, int(i)]), self.sides)

  def __getitem__(self, i) -> tuple[str, list[np.ndarray]]:
    i = int(i)
    if not 0 <= i < self.num_docs:
      raise IndexError(f"document index {i} out of range for {self.num_docs} documents")
    rng = np.random.default_rng([self.seed, i, 1])
    truth = self.truth(i)
    qs = questions(truth)
    img = render_scene(truth, self.channels)
    if rng.random() < 0.2:  # a caption document: the image, then its description
      return f"<image>\nCaption: {caption(truth)}\n", [img]
    # One question per image copy (see vqa_text), QA_PER_DOC questions per document drawn
    # without replacement, each with its type's weight.
    w = np.array([self.question_weights[kind] for kind, _, _ in qs], np.float64)
    pick = rng.choice(len(qs), size=min(QA_PER_DOC, len(qs)), replace=False, p=w / w.sum())
    text, spans = "", []
    for j in pick:
      _, q, a = qs[j]
      text += vqa_text(q)
      spans.append((len(text), len(text) + len(f" {a}\n")))  # " <answer>\n" is the answer
      text += f" {a}\n"
    return text, [img] * len(pick), tuple(spans)
