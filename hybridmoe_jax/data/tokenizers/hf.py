"""A Hugging Face `tokenizer.json` under the `base.Tokenizer` contract, through the
`tokenizers` library (imported only when such a file is loaded). Roles as for every file
tokenizer (`base.FileTokenizer`); `load.make_tokenizer` picks this class for a JSON file.
"""

from __future__ import annotations

import json
import re

import numpy as np

from hybridmoe_jax.data.tokenizers.base import (CONFIG_FILE, CONFIG_ROLE_FIELDS, RESERVED,
                                                FileTokenizer, TokenizerError, assign_roles,
                                                import_optional, read_config, roles_for,
                                                special_mask, token_name)

HF_FILE = "tokenizer.json"


def _bytes_to_unicode() -> dict[str, int]:
  """GPT-2 byte-level alphabet, inverted: printable character -> the byte it stands for.

  Bytes that are printable Latin-1 characters stand for themselves; the other 68 bytes map,
  in byte order, to the code points 256, 257, ...
  """
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  other = [b for b in range(256) if b not in keep]
  return {chr(b): b for b in keep} | {chr(256 + k): b for k, b in enumerate(other)}


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
