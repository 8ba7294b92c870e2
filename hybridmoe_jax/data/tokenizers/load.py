"""The one way to build, save and read back a tokenizer.

`make_tokenizer(spec)`: data.tokenizer's value -> a tokenizer: "byte" / "byte_chat"
(`byte.ByteTokenizer`), or a path to a tokenizer.json (`hf.HFTokenizer`), a tiktoken model
file (`tiktoken_bpe.TiktokenTokenizer`) or a directory holding one (a tokenizer_config.json
beside it names special tokens). A run keeps a copy in `<workdir>/tokenizer/`
(`save_tokenizer`), read back by `tokenizer_from_dir`; `fingerprint` says whether two are
the same tokenizer and `check_vocab` whether the model can embed its ids.
"""

from __future__ import annotations

import filecmp
import hashlib
import os
import shutil

from hybridmoe_jax.data.tokenizers.base import CONFIG_FILE, Tokenizer, TokenizerError
from hybridmoe_jax.data.tokenizers.byte import BYTE_CHAT_SPEC, BYTE_SPEC, ByteTokenizer
from hybridmoe_jax.data.tokenizers.hf import HF_FILE, HFTokenizer
from hybridmoe_jax.data.tokenizers.tiktoken_bpe import TIKTOKEN_FILE, TiktokenTokenizer

SPEC_HELP = ("allowed: 'byte', a tokenizer.json, a tiktoken model file, or a directory "
             f"holding {HF_FILE} or {TIKTOKEN_FILE}")
TOKENIZER_DIR = "tokenizer"  # a run's copy of its tokenizer: <workdir>/tokenizer/
# Written into <workdir>/tokenizer/ for a byte_chat run, so evals rebuild the same ids.
BYTE_CHAT_MARKER = "byte_chat.json"


def find_tokenizer_file(directory: str) -> str | None:
  """The tokenizer file of a directory: tokenizer.json, else tiktoken.model, else None."""
  for name in (HF_FILE, TIKTOKEN_FILE):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      return path
  return None


def _sniff_kind(path: str) -> str:
  """"hf" for a JSON file, "tiktoken" otherwise (decided by the first non-space byte)."""
  try:
    with open(path, "rb") as f:
      head = f.read(4096).lstrip()
  except OSError as e:
    raise TokenizerError(f"tokenizer file {path} cannot be read: {e.strerror or e}") from None
  if not head:
    raise TokenizerError(f"tokenizer file {path} is empty")
  return "hf" if head[:1] == b"{" else "tiktoken"


def resolve(spec: str) -> tuple[str, str, str | None]:
  """A tokenizer path -> (kind "hf" | "tiktoken", file, tokenizer_config.json or None)."""
  if os.path.isdir(spec):
    path = find_tokenizer_file(spec)
    if path is None:
      raise TokenizerError(f"data.tokenizer = {spec!r}: the directory holds neither {HF_FILE} "
                           f"nor {TIKTOKEN_FILE} ({SPEC_HELP})")
  elif os.path.isfile(spec):
    path = spec
  else:
    raise TokenizerError(f"data.tokenizer = {spec!r}: no such file or directory ({SPEC_HELP})")
  config = os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG_FILE)
  return _sniff_kind(path), path, config if os.path.isfile(config) else None


def _sha256_file(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


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
    spec: "byte", "byte_chat" (bytes + the chat roles of rl/chat_format.py), or a path: a
      Hugging Face tokenizer.json, a tiktoken BPE file (lines `base64(token bytes) rank`,
      Kimi's tiktoken.model format) or a directory holding one (tokenizer.json or
      tiktoken.model; a tokenizer_config.json beside it names special tokens).
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
  """A tokenizer.json / tiktoken file, or a directory holding one (`resolve`); the
  `tokenizers` / `tiktoken` package is imported by the class, only when one is built."""
  kind, path, config = resolve(spec)
  cls = HFTokenizer if kind == "hf" else TiktokenTokenizer
  return cls(path, config, vision=vision)


def tokenizer_from_dir(directory: str, *, vision: bool = False) -> Tokenizer:
  """The tokenizer saved in `directory` (e.g. <workdir>/tokenizer), the byte tokenizer when
  it holds none (runs from before file tokenizers, and byte-tokenizer runs).

  Raises:
    TokenizerError: the directory holds a tokenizer file that cannot be read.
  """
  if os.path.isdir(directory) and find_tokenizer_file(directory):
    return _load_file_tokenizer(directory, vision)
  return ByteTokenizer(vision=vision,
                       chat=os.path.isfile(os.path.join(directory, BYTE_CHAT_MARKER)))


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> list[str]:
  """Copies a file tokenizer's files into `directory` so the run is self-contained.

  Nothing is written for the byte tokenizer, a one-line marker for the chat byte tokenizer
  (BYTE_CHAT_MARKER). Files already there are kept when identical;
  a different tokenizer already saved there is an error (a workdir trains with one; nothing
  is overwritten).

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
  files = getattr(tokenizer, "files", None)   # {saved name: source path}
  if not files:
    return []
  # One tokenizer file per directory (find_tokenizer_file would prefer tokenizer.json).
  other = {HF_FILE: TIKTOKEN_FILE, TIKTOKEN_FILE: HF_FILE}
  for name in files:
    if name in other and os.path.exists(os.path.join(directory, other[name])):
      raise TokenizerError(f"{directory} already holds {other[name]}, another tokenizer than "
                           f"data.tokenizer ({files[name]}); use a fresh --workdir")
  try:
    os.makedirs(directory, exist_ok=True)
    out = []
    for name, src in sorted(files.items()):
      dst = os.path.join(directory, name)
      if os.path.exists(dst):
        if not filecmp.cmp(src, dst, shallow=False):
          raise TokenizerError(
              f"{dst} holds another tokenizer than data.tokenizer ({src}): this workdir was "
              "trained with that one; use the same data.tokenizer or a fresh --workdir")
      elif os.path.abspath(src) != os.path.abspath(dst):
        shutil.copyfile(src, dst)
      out.append(dst)
  except OSError as e:
    raise TokenizerError(f"cannot save the tokenizer into {directory}: "
                         f"{e.strerror or e}") from None
  return out
