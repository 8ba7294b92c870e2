"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then PAD, BOS and EOS.

Every string is representable, nothing has to be trained or downloaded, and the
vocabulary (259) is tiny, which suits the small offline configs. The special ids
sit after the bytes because byte 0 is a legal byte: a pad id of 0 would make a
NUL character indistinguishable from padding.

Vision models (`ByteTokenizer(vision=True)`) add three more ids after EOS: IMAGE_START,
IMAGE_END and IMAGE_PAD (the placeholder the model replaces with projected image tokens),
for a vocabulary of 262; text-only models keep exactly 259.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
IMAGE_START_ID = 259
IMAGE_END_ID = 260
IMAGE_PAD_ID = 261
IMAGE_IDS = (IMAGE_START_ID, IMAGE_END_ID, IMAGE_PAD_ID)
_NUM_BYTES = 256


class Tokenizer(Protocol):
  """What the pipeline needs from a tokenizer."""

  pad_id: int

  @property
  def vocab_size(self) -> int: ...

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray: ...


class ByteTokenizer:
  """UTF-8 bytes as token ids; vocab = 256 bytes + pad (256) + bos (257) + eos (258), and
  with vision=True also image_start (259), image_end (260), image_pad (261)."""

  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  image_start_id = IMAGE_START_ID
  image_end_id = IMAGE_END_ID
  image_pad_id = IMAGE_PAD_ID

  def __init__(self, vision: bool = False):
    self.vision = bool(vision)

  @property
  def vocab_size(self) -> int:
    return _NUM_BYTES + (6 if self.vision else 3)

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
    """Encodes `text` as its UTF-8 bytes.

    Args:
      text: any str (lone surrogates are rejected by the UTF-8 codec).
      bos: prepend BOS_ID.
      eos: append EOS_ID.

    Returns:
      ids: int32 [n] with n = len(text.encode("utf-8")) + bos + eos.
    """
    body = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    if not (bos or eos):
      return body
    parts = [np.array([BOS_ID], np.int32)] if bos else []
    parts.append(body)
    if eos:
      parts.append(np.array([EOS_ID], np.int32))
    return np.concatenate(parts)

  def decode(self, ids) -> str:
    """Decodes ids back to text; special ids are dropped, bad UTF-8 becomes U+FFFD.

    Args:
      ids: integer array-like of any shape (flattened), values in [0, vocab_size).

    Raises:
      ValueError: an id lies outside [0, vocab_size).
    """
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      bad = ids[(ids < 0) | (ids >= self.vocab_size)][0]
      raise ValueError(f"token id {int(bad)} is outside the byte vocabulary [0, {self.vocab_size})")
    # errors="replace": a packed row may cut a multi-byte character in two.
    return ids[ids < _NUM_BYTES].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Fails before training if the tokenizer can emit ids the model cannot embed.

  Raises:
    ValueError: tokenizer.vocab_size > model_vocab_size (both are named).
  """
  if tokenizer.vocab_size > model_vocab_size:
    raise ValueError(
        f"tokenizer vocab_size {tokenizer.vocab_size} > model vocab_size {model_vocab_size}: "
        f"token ids up to {tokenizer.vocab_size - 1} would index past the embedding table; "
        f"set model.vocab_size >= {tokenizer.vocab_size}")
