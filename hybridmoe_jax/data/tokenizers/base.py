"""The tokenizer contract: special tokens by ROLE, the `Tokenizer` protocol every tokenizer
meets, its error type, and the base of the file tokenizers.

A pipeline never names a special id: it asks the tokenizer for a role's id (`pad_id`,
`special_ids["end_turn"]`), and `token_bytes()` gives each id's UTF-8 byte count (bits per
byte for any vocabulary). The tokenizers: bytes (`byte.py`), a Hugging Face tokenizer.json
(`hf.py`), a tiktoken BPE file (`tiktoken_bpe.py`); `load.py` is the one way to build,
save and read one back.

File tokenizers (`FileTokenizer`) give their special tokens by role (pad, bos, eos, the chat
roles, and the image roles with vision), in that fixed order: a role takes the token its
tokenizer_config.json names (bos_token, eos_token, pad_token), else a special token of the
vocabulary with one of the role's known names (`ROLE_TOKENS`: Kimi's [BOS], [EOS],
<|im_user|>, ...), else the first free reserved slot, else a new id after the vocabulary.
The order and the file fix the ids, so every load gives the same ones, and the text roles
keep their ids with or without vision. Encoding treats special-token text in a document
("<|im_end|>") as plain text: a special id only enters a sequence through its role, so an
image id is never a real token.
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Any, Callable, Protocol

import numpy as np

# Every tokenizer has the text roles; the image roles only with vision; the chat / tool roles
# belong to the chat and tool-call format (rl/chat_format.py): file tokenizers map or add
# them, the byte tokenizer carries them with chat=True.
TEXT_ROLES = ("pad", "bos", "eos")
CHAT_ROLES = ("system", "user", "assistant", "tool_call", "tool_result", "answer", "end_turn")
IMAGE_ROLES = ("image_start", "image_end", "image_pad")


class TokenizerError(ValueError):
  """A tokenizer that cannot be used: missing or corrupt file, unknown spec, a special
  token it names but does not hold. The message is one line naming the file or field."""


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


CONFIG_FILE = "tokenizer_config.json"
EXTRA = "pip install 'hybridmoe_jax[tokenizers]'"

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
