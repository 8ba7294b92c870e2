"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then PAD, BOS and EOS.

Every string is representable, nothing is trained or downloaded, and the vocabulary (259)
suits the small offline configs. The special ids follow the bytes because byte 0 is legal:
a pad id of 0 would make NUL indistinguishable from padding.

`ByteTokenizer(vision=True)` adds IMAGE_START, IMAGE_END and IMAGE_PAD (the placeholder the
model replaces with projected image tokens) after EOS: vocabulary 262. The chat / tool-call
roles (CHAT_ROLES, the format of `rl/chat_format.py`) are opt-in: `ByteTokenizer(chat=True)`
appends their 7 ids, in CHAT_ROLES order, after the last id it has:
  chat:              system 259, user 260, ..., end_turn 265; vocabulary 266
  vision and chat:   system 262, user 263, ..., end_turn 268; vocabulary 269
so turning chat on never renumbers a byte, text or image id.

It meets the contract of `base.Tokenizer` like the file tokenizers; `load.make_tokenizer`
builds it for data.tokenizer = "byte" / "byte_chat".
"""

from __future__ import annotations

import numpy as np

from hybridmoe_jax.data.tokenizers.base import CHAT_ROLES

PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
IMAGE_START_ID = 259
IMAGE_END_ID = 260
IMAGE_PAD_ID = 261
IMAGE_IDS = (IMAGE_START_ID, IMAGE_END_ID, IMAGE_PAD_ID)
_NUM_BYTES = 256
_NUM_CHAT = len(CHAT_ROLES)

BYTE_SPEC = "byte"
BYTE_CHAT_SPEC = "byte_chat"   # the byte tokenizer with the chat roles (RL runs)


class ByteTokenizer:
  """UTF-8 bytes as token ids; vocab = 256 bytes + pad (256) + bos (257) + eos (258), and
  with vision=True also image_start (259), image_end (260), image_pad (261); with chat=True
  the 7 CHAT_ROLES ids follow the last of those (see the module docstring)."""

  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  name = BYTE_SPEC

  def __init__(self, vision: bool = False, chat: bool = False):
    self.vision = bool(vision)
    self.chat = bool(chat)
    # The image ids exist only in the vision vocabulary (262 ids).
    self.image_start_id = IMAGE_START_ID if self.vision else None
    self.image_end_id = IMAGE_END_ID if self.vision else None
    self.image_pad_id = IMAGE_PAD_ID if self.vision else None

  @property
  def _chat_start(self) -> int:
    """The first chat id: right after EOS, or after IMAGE_PAD with vision."""
    return (IMAGE_PAD_ID if self.vision else EOS_ID) + 1

  @property
  def vocab_size(self) -> int:
    return self._chat_start + (_NUM_CHAT if self.chat else 0)

  @property
  def special_ids(self) -> dict[str, int]:
    """Role -> id: pad, bos, eos (and image_start, image_end, image_pad with vision; the
    CHAT_ROLES with chat)."""
    out = {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID}
    if self.vision:
      out.update(image_start=IMAGE_START_ID, image_end=IMAGE_END_ID, image_pad=IMAGE_PAD_ID)
    if self.chat:
      out.update({role: self._chat_start + i for i, role in enumerate(CHAT_ROLES)})
    return out

  def token_bytes(self) -> np.ndarray:
    """int32 [vocab_size]: 1 for the 256 byte ids, 0 for the special ids."""
    return (np.arange(self.vocab_size) < _NUM_BYTES).astype(np.int32)

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
    return np.concatenate([np.full(int(bos), BOS_ID, np.int32), body,
                           np.full(int(eos), EOS_ID, np.int32)])

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
