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

Every tokenizer (this one, and the BPEs of `hf_tokenizers`: tokenizer.json or a tiktoken
model file) meets one contract, `Tokenizer`: special tokens are looked up by ROLE, never by
a module constant, and `token_bytes()` gives each id's UTF-8 byte count (bits per byte for
any vocabulary). `make_tokenizer("byte" | path)` builds one from `data.tokenizer`; a run
keeps a copy in `workdir/tokenizer/` (`save_tokenizer`), read back by `tokenizer_from_dir`.
"""

from __future__ import annotations

import hashlib
import os
from typing import Protocol

import numpy as np

# Role names and the error type live in token_roles (shared with hf_tokenizers).
from hybridmoe_jax.data.token_roles import (  # noqa: F401 (re-exported)
    CHAT_ROLES, IMAGE_ROLES, TEXT_ROLES, TokenizerError)

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
# Written into <workdir>/tokenizer/ for a byte_chat run, so evals rebuild the same ids.
BYTE_CHAT_MARKER = "byte_chat.json"


class Tokenizer(Protocol):
  """What the pipelines, the train loop and the evals need from a tokenizer.

  Special ids are reached by role; image ids are None for a tokenizer without vision
  tokens. `special_ids` maps every role the tokenizer carries to its id.
  """

  pad_id: int
  bos_id: int
  eos_id: int
  image_start_id: int | None
  image_end_id: int | None
  image_pad_id: int | None

  @property
  def vocab_size(self) -> int: ...

  @property
  def special_ids(self) -> dict[str, int]: ...

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray: ...

  def decode(self, ids) -> str: ...

  def token_bytes(self) -> np.ndarray: ...


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


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def fingerprint(tokenizer: Tokenizer) -> dict:
  """Class, flags, vocabulary size and file hashes: equal iff the same tokenizer (a run's
  workdir/inputs.json and a prepared shard set's index.json both record it)."""
  files = getattr(tokenizer, "files", None) or {}
  return {"kind": type(tokenizer).__name__, "chat": bool(getattr(tokenizer, "chat", False)),
          "vision": getattr(tokenizer, "image_pad_id", None) is not None,
          "vocab_size": int(tokenizer.vocab_size),
          "files": {name: _sha256_file(src) for name, src in sorted(files.items())}}


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Fails before training if the tokenizer can emit ids the model cannot embed.

  Raises:
    ValueError: tokenizer.vocab_size > model_vocab_size (both are named, and the file of a
      file tokenizer).
  """
  if tokenizer.vocab_size > model_vocab_size:
    name = getattr(tokenizer, "name", BYTE_SPEC)
    where = "" if name == BYTE_SPEC else f"{name}: "
    raise ValueError(
        f"{where}tokenizer vocab_size {tokenizer.vocab_size} > model vocab_size "
        f"{model_vocab_size}: "
        f"token ids up to {tokenizer.vocab_size - 1} would index past the embedding table; "
        f"set model.vocab_size >= {tokenizer.vocab_size}")


def make_tokenizer(spec: str, *, vision: bool = False) -> Tokenizer:
  """The tokenizer of a `data.tokenizer` value.

  Args:
    spec: "byte", "byte_chat" (bytes + the chat roles of rl/chat_format.py), or a path: a Hugging Face tokenizer.json, a tiktoken BPE file (lines
      `base64(token bytes) rank`, Kimi's tiktoken.model format) or a directory holding one
      (tokenizer.json or tiktoken.model; a tokenizer_config.json beside it names special
      tokens).
    vision: also give the image roles ids (image_start, image_end, image_pad).

  Raises:
    TokenizerError: one line naming the path and what is wrong (missing, unreadable,
      corrupt, a named special token it lacks), or the missing `tokenizers` / `tiktoken`
      package and the extra that installs it.
  """
  if not isinstance(spec, str) or not spec:
    raise TokenizerError(f"data.tokenizer = {spec!r}: allowed {BYTE_SPEC!r}, "
                         f"{BYTE_CHAT_SPEC!r} or a path to a tokenizer.json, a tiktoken model "
                         "file, or a directory holding one")
  if spec in (BYTE_SPEC, BYTE_CHAT_SPEC):
    return ByteTokenizer(vision=vision, chat=spec == BYTE_CHAT_SPEC)
  return _load_file_tokenizer(spec, vision)


def _load_file_tokenizer(spec: str, vision: bool) -> Tokenizer:
  """A tokenizer.json / tiktoken file, or a directory holding one (hf_tokenizers.resolve).
  Imported here: tokenizers / tiktoken load only when a file tokenizer is asked for."""
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.data import hf_tokenizers, tiktoken_tokenizer
  kind, path, config = hf_tokenizers.resolve(spec)
  cls = hf_tokenizers.HFTokenizer if kind == "hf" else tiktoken_tokenizer.TiktokenTokenizer
  return cls(path, config, vision=vision)


TOKENIZER_DIR = "tokenizer"  # a run's copy of its tokenizer: <workdir>/tokenizer/


def tokenizer_from_dir(directory: str, *, vision: bool = False) -> Tokenizer:
  """The tokenizer saved in `directory` (e.g. <workdir>/tokenizer), the byte tokenizer when
  it holds none (runs from before file tokenizers, and byte-tokenizer runs).

  Raises:
    TokenizerError: the directory holds a tokenizer file that cannot be read.
  """
  from hybridmoe_jax.data import hf_tokenizers  # pylint: disable=g-import-not-at-top
  if os.path.isdir(directory) and hf_tokenizers.find_tokenizer_file(directory):
    return _load_file_tokenizer(directory, vision)
  return ByteTokenizer(vision=vision,
                       chat=os.path.isfile(os.path.join(directory, BYTE_CHAT_MARKER)))


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> list[str]:
  """Copies a file tokenizer's files into `directory` so the run is self-contained.

  Nothing is written for the byte tokenizer, a one-line marker for the chat byte tokenizer
  (BYTE_CHAT_MARKER). Files already there are kept when identical;
  a different tokenizer already saved there is an error (a workdir trains with one).

  Returns:
    The paths written or found identical.

  Raises:
    TokenizerError: `directory` already holds a different tokenizer file.
  """
  if isinstance(tokenizer, ByteTokenizer) and tokenizer.chat:
    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, BYTE_CHAT_MARKER)
    if not os.path.exists(marker):
      with open(marker, "w") as f:
        f.write('{"tokenizer": "byte_chat"}\n')
    return [marker]
  files = getattr(tokenizer, "files", None)
  if not files:
    return []
  from hybridmoe_jax.data import hf_tokenizers  # pylint: disable=g-import-not-at-top
  return hf_tokenizers.copy_files(files, directory)
