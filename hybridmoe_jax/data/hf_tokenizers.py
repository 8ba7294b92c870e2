"""File tokenizers under the one `Tokenizer` contract (see data/tokenizer.py).

Two formats, each loaded from a local path:
  * a Hugging Face `tokenizer.json`, through the `tokenizers` library (here);
  * a tiktoken BPE file (Kimi's `tiktoken.model`), through `tiktoken`
    (data/tiktoken_tokenizer.py).
This file holds what both share (file lookup, role assignment, the FileTokenizer base) and
the tokenizer.json format; `data.tokenizer.make_tokenizer` picks the class.

Special tokens by role (pad, bos, eos, the chat roles, and the image roles with vision), in
that fixed order: a role takes the token its tokenizer_config.json names (bos_token,
eos_token, pad_token), else a special token of the vocabulary with one of the role's known
names (`ROLE_TOKENS`: Kimi's [BOS], [EOS], <|im_user|>, ...), else the first free reserved
slot, else a new id after the vocabulary. The order and the file fix the ids, so every
load gives the same ones, and the text roles keep their ids with or without vision.

Encoding treats special-token text in a document ("<|im_end|>") as plain text: a special
id only enters a sequence through its role. An image id is therefore never a real token.
`tokenizers` and `tiktoken` are imported only when such a file is loaded.
"""

from __future__ import annotations

import filecmp
import importlib
import json
import os
import re
import shutil
from typing import Any, Callable

import numpy as np

from hybridmoe_jax.data.token_roles import (CHAT_ROLES, IMAGE_ROLES, TEXT_ROLES,
                                            TokenizerError)

HF_FILE = "tokenizer.json"
TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
EXTRA = "pip install 'hybridmoe_jax[tokenizers]'"
SPEC_HELP = ("allowed: 'byte', a tokenizer.json, a tiktoken model file, or a directory "
             f"holding {HF_FILE} or {TIKTOKEN_FILE}")

# Role -> token names, the first being the name a role gets when it is added; the others
# are the names other vocabularies use for it (Kimi, Llama 3, Qwen, GPT-2, SentencePiece).
ROLE_TOKENS: dict[str, tuple[str, ...]] = {
    "pad": ("<|pad|>", "[PAD]", "<pad>", "<|finetune_right_pad_id|>"),
    "bos": ("<|bos|>", "[BOS]", "<s>", "<|begin_of_text|>", "<|startoftext|>"),
    "eos": ("<|eos|>", "[EOS]", "</s>", "<|end_of_text|>", "<|endoftext|>"),
    "system": ("<|system|>", "<|im_system|>"),
    "user": ("<|user|>", "<|im_user|>"),
    "assistant": ("<|assistant|>", "<|im_assistant|>"),
    "tool_call": ("<|tool_call|>", "<|tool_call_begin|>", "<tool_call>"),
    "tool_result": ("<|tool_result|>", "<|tool_response|>", "<tool_response>"),
    "answer": ("<|answer|>",),
    "end_turn": ("<|end_turn|>", "<|im_end|>", "<|eot_id|>", "[EOT]"),
    "image_start": ("<|image_start|>", "<|media_start|>", "<|vision_start|>"),
    "image_end": ("<|image_end|>", "<|media_end|>", "<|vision_end|>"),
    "image_pad": ("<|image_pad|>", "<|media_pad|>"),
}
# tokenizer_config.json fields that name a role's token.
CONFIG_ROLE_FIELDS = {"pad": "pad_token", "bos": "bos_token", "eos": "eos_token"}
RESERVED = re.compile(r"^<\|reserved(_special)?_token_\d+\|>$")


def import_optional(name: str):
  """The `tokenizers` / `tiktoken` module; TokenizerError naming the extra when missing."""
  try:
    return importlib.import_module(name)
  except ImportError:
    raise TokenizerError(f"this tokenizer file needs the `{name}` package, which is not "
                         f"installed: {EXTRA}") from None


# ---------------------------------------------------------------------------- finding files


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


def read_config(path: str | None) -> dict[str, Any]:
  if path is None:
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      out = json.load(f)
  except (OSError, ValueError) as e:
    raise TokenizerError(f"tokenizer config {path} is not readable JSON: "
                         f"{str(e).splitlines()[0]}") from None
  if not isinstance(out, dict):
    raise TokenizerError(f"tokenizer config {path} is not a JSON object")
  return out


def token_name(value) -> str | None:
  """A tokenizer_config token field: a string, {"content": str}, or null."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


# --------------------------------------------------------------------------- special roles


def assign_roles(roles, *, specials: dict[str, int], free: list[int], end: int,
                 config_names: dict[str, str], lookup: Callable[[str], int | None],
                 where: str) -> tuple[dict[str, int], dict[str, str], int]:
  """Gives each role an id (see the module docstring for the order of preference).

  Args:
    roles: role names, in the fixed order ids are handed out.
    specials: special-token name -> id of the vocabulary (never produced by encode).
    free: reserved special ids, in order, that no name claims (taken before adding).
    end: the first id after the vocabulary (the next added id).
    config_names: role -> token name from tokenizer_config.json.
    lookup: any token name -> id (None when absent), for the names config_names gives.
    where: the config file, for the error message.

  Returns:
    (role -> id, role -> token name, the new end of the vocabulary).

  Raises:
    TokenizerError: tokenizer_config.json names a token the vocabulary does not hold.
  """
  ids, names, taken, free = {}, {}, set(), list(free)
  for role in roles:
    choice = None
    if role in config_names:
      name = config_names[role]
      tid = specials.get(name, lookup(name))
      if tid is None:
        raise TokenizerError(f"{where}: {CONFIG_ROLE_FIELDS[role]} {name!r} is not a token of "
                             "the vocabulary and cannot be added under that name; remove "
                             "the field or fix the name")
      choice = (tid, name)
    else:
      for name in ROLE_TOKENS[role]:
        if name in specials and specials[name] not in taken:
          choice = (specials[name], name)
          break
    if choice is None:
      if free:
        choice = (free.pop(0), ROLE_TOKENS[role][0])
      else:
        choice, end = (end, ROLE_TOKENS[role][0]), end + 1
    ids[role], names[role] = choice
    taken.add(choice[0])
  return ids, names, end


def roles_for(vision: bool) -> tuple[str, ...]:
  return TEXT_ROLES + CHAT_ROLES + (IMAGE_ROLES if vision else ())


# ------------------------------------------------------------------------------ base class


class FileTokenizer:
  """Shared part of the file tokenizers: roles, special mask, validation, decode filter.

  Subclasses set `_body_encode(text) -> list[int]`, `_body_decode(ids) -> str` and
  `_body_bytes() -> int32 [vocab]` (UTF-8 bytes per id; specials are zeroed here).
  """

  kind = ""

  def __init__(self, *, name: str, files: dict[str, str], role_ids: dict[str, int],
               role_names: dict[str, str], special: np.ndarray, vision: bool):
    self.name = name                # the tokenizer file (for messages)
    self.files = dict(files)        # saved name -> source path (save_tokenizer copies them)
    self.vision = bool(vision)
    self.role_names = dict(role_names)
    self._roles = dict(role_ids)
    self._special = special         # bool [vocab_size]: never a text token
    self._token_bytes = None
    self.pad_id = role_ids["pad"]
    self.bos_id = role_ids["bos"]
    self.eos_id = role_ids["eos"]
    self.image_start_id = role_ids.get("image_start")
    self.image_end_id = role_ids.get("image_end")
    self.image_pad_id = role_ids.get("image_pad")

  @property
  def vocab_size(self) -> int:
    return int(self._special.shape[0])

  @property
  def special_ids(self) -> dict[str, int]:
    return dict(self._roles)

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
    """text -> int32 [n] (+ BOS in front, EOS at the end when asked).

    Special-token text inside `text` is encoded as plain text, never as a special id.
    """
    body = self._body_encode(text)
    return np.asarray(([self.bos_id] if bos else []) + list(body) + ([self.eos_id] if eos
                                                                      else []), np.int32)

  def decode(self, ids) -> str:
    """ids (any shape, flattened) -> text; special ids are dropped, a cut multi-byte
    character becomes U+FFFD.

    Raises:
      ValueError: an id lies outside [0, vocab_size).
    """
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      bad = ids[(ids < 0) | (ids >= self.vocab_size)][0]
      raise ValueError(f"token id {int(bad)} is outside the vocabulary [0, {self.vocab_size}) "
                       f"of {self.name}")
    return self._body_decode([int(i) for i in ids[~self._special[ids]]])

  def token_bytes(self) -> np.ndarray:
    """int32 [vocab_size]: UTF-8 bytes of each id's text; 0 for special ids."""
    if self._token_bytes is None:  # one pass over the vocabulary, then cached
      out = np.zeros(self.vocab_size, np.int32)
      body = self._body_bytes()
      out[:len(body)] = body
      out[self._special] = 0
      self._token_bytes = out
    return self._token_bytes.copy()

  def __repr__(self) -> str:
    return (f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, "
            f"vision={self.vision})")


def special_mask(vocab_size: int, special_ids) -> np.ndarray:
  mask = np.zeros(vocab_size, bool)
  mask[list(special_ids)] = True
  return mask


# --------------------------------------------------------------------------- tokenizer.json


def _bytes_to_unicode() -> dict[str, int]:
  """GPT-2 byte-level alphabet, inverted: printable character -> the byte it stands for.

  Bytes that are printable Latin-1 characters stand for themselves; the other 68 bytes map,
  in byte order, to the code points 256, 257, ...
  """
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  out, extra = {}, 0
  for b in range(256):
    if b in keep:
      out[chr(b)] = b
    else:
      out[chr(256 + extra)] = b
      extra += 1
  return out


def _has_type(node, name: str) -> bool:
  """Whether a tokenizer.json component (or a Sequence of them) has type `name`."""
  if isinstance(node, dict):
    if node.get("type") == name:
      return True
    return any(_has_type(v, name) for v in node.values() if isinstance(v, (dict, list)))
  if isinstance(node, list):
    return any(_has_type(v, name) for v in node)
  return False


class HFTokenizer(FileTokenizer):
  """A Hugging Face tokenizer.json through the `tokenizers` library."""

  kind = "hf"

  def __init__(self, path: str, config_path: str | None = None, *, vision: bool = False):
    lib = import_optional("tokenizers")
    try:
      with open(path, encoding="utf-8") as f:
        spec = json.load(f)
      if not isinstance(spec, dict) or "model" not in spec:
        raise ValueError("no 'model' section")
      self._tok = lib.Tokenizer.from_str(json.dumps(spec))
    except Exception as e:  # pylint: disable=broad-except (the library raises Exception)
      msg = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise TokenizerError(f"tokenizer file {path} is not a valid Hugging Face tokenizer.json: "
                           f"{msg}") from None
    # Special-token text in documents stays text (see the module docstring).
    self._tok.encode_special_tokens = True
    self._spec = spec
    hf_vocab = self._tok.get_vocab(with_added_tokens=True)
    hf_size = max(hf_vocab.values()) + 1 if hf_vocab else 0
    added = [t for t in spec.get("added_tokens") or [] if isinstance(t, dict)]
    specials = {t["content"]: int(t["id"]) for t in added if t.get("special")}
    self._added_text = {int(t["id"]): t["content"] for t in added if not t.get("special")}
    free = sorted(i for n, i in specials.items() if RESERVED.match(n))
    config = read_config(config_path)
    names = {r: n for r, f in CONFIG_ROLE_FIELDS.items() if (n := token_name(config.get(f)))}
    claimed = {n: i for n, i in specials.items() if not RESERVED.match(n)}
    role_ids, role_names, end = assign_roles(
        roles_for(vision), specials=claimed, free=free, end=hf_size, config_names=names,
        lookup=self._tok.token_to_id, where=config_path or path)
    special = special_mask(end, list(specials.values()) + list(role_ids.values()))
    files = {HF_FILE: path} | ({CONFIG_FILE: config_path} if config_path else {})
    super().__init__(name=path, files=files, role_ids=role_ids, role_names=role_names,
                     special=special, vision=vision)
    self._hf_size = hf_size

  def _body_encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def _body_decode(self, ids: list[int]) -> str:
    return self._tok.decode(ids, skip_special_tokens=True)

  def _body_bytes(self) -> np.ndarray:
    """Bytes per id: exact for byte-level BPE (the GPT-2 alphabet) and for SentencePiece
    style vocabularies (U+2581 for a space, <0xNN> byte fallback); other models decode
    each id alone, which miscounts only pieces of a multi-byte character."""
    out = np.zeros(self._hf_size, np.int32)
    byte_level = _has_type(self._spec.get("decoder"), "ByteLevel")
    alphabet = _bytes_to_unicode() if byte_level else {}
    for i in range(self._hf_size):
      if i in self._added_text:
        out[i] = len(self._added_text[i].encode("utf-8"))
        continue
      piece = self._tok.id_to_token(i)
      if piece is None:
        continue
      if byte_level:
        out[i] = sum(1 for ch in piece if ch in alphabet)
      elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
        out[i] = 1
      elif "\u2581" in piece:
        out[i] = len(piece.replace("\u2581", " ").encode("utf-8"))
      else:
        out[i] = len(self._tok.decode([i], skip_special_tokens=False).encode("utf-8"))
    return out


# ---------------------------------------------------------------------------- entry points


def copy_files(files: dict[str, str], directory: str) -> list[str]:
  """Copies {saved name: source} into `directory`; identical files already there are kept.

  Raises:
    TokenizerError: a different file of that name is already there (never overwritten).
  """
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
