"""Kimi's tiktoken BPE files under the one `Tokenizer` contract (`base.Tokenizer`).

`tiktoken.model`: one `base64(token bytes) rank` per line, ranks 0..n-1, encoded through
`tiktoken` with Kimi's pre-tokenizer split. As in Kimi, special-token slots follow the ranks:
ids n .. n + 257, named by the `added_tokens_decoder` of a `tokenizer_config.json` beside the
file; unnamed slots are reserved. Roles are assigned as for every file tokenizer
(`base.FileTokenizer`).
"""

from __future__ import annotations

import base64
import binascii
import os

import numpy as np

from hybridmoe_jax.data.tokenizers.base import (CONFIG_FILE, CONFIG_ROLE_FIELDS, RESERVED,
                                                FileTokenizer, TokenizerError, assign_roles,
                                                import_optional, read_config, roles_for,
                                                special_mask, token_name)

TIKTOKEN_FILE = "tiktoken.model"

# Kimi's pre-tokenizer split: runs of Han characters; words (optionally led by one
# non-letter, with English contractions); 1-3 digits; punctuation runs; newlines; spaces.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
     r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"),
    (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
     r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"),
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# Kimi numbers 256 reserved special tokens plus 2 after the BPE ranks.
TIKTOKEN_SPECIAL_SLOTS = 256 + 2


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
  """Lines `base64(token bytes) rank` -> {token bytes: rank}, ranks exactly 0..n-1.

  Raises:
    TokenizerError: naming the file and line of the first bad entry.
  """
  ranks: dict[bytes, int] = {}
  try:
    with open(path, "rb") as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        parts = line.split()
        try:
          if len(parts) != 2:
            raise ValueError(f"expected 'base64 rank', got {len(parts)} fields")
          token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
          raise TokenizerError(f"tiktoken file {path} line {lineno} is not "
                               f"'base64(token bytes) rank': {e}") from None
        if token in ranks:
          raise TokenizerError(f"tiktoken file {path} line {lineno}: token {token!r} appears "
                               "twice")
        ranks[token] = rank
  except OSError as e:
    raise TokenizerError(f"tiktoken file {path} cannot be read: {e.strerror or e}") from None
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise TokenizerError(f"tiktoken file {path}: the ranks are not exactly 0..{len(ranks) - 1} "
                         "(one per token, no gaps)")
  missing = [b for b in range(256) if bytes([b]) not in ranks]
  if missing:
    raise TokenizerError(f"tiktoken file {path} lacks {len(missing)} single-byte tokens "
                         f"(first: byte {missing[0]}): every byte needs a rank, else text "
                         "holding it cannot be encoded")
  return ranks


class TiktokenTokenizer(FileTokenizer):
  """A tiktoken BPE file (Kimi's tiktoken.model format) through `tiktoken`."""

  kind = "tiktoken"

  def __init__(self, path: str, config_path: str | None = None, *, vision: bool = False):
    lib = import_optional("tiktoken")
    ranks = read_tiktoken_ranks(path)
    base = len(ranks)
    config = read_config(config_path)
    named: dict[str, int] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
      name = token_name(entry)
      if not (str(key).isdecimal() and name):  # isdigit would pass "²", which int() refuses
        raise TokenizerError(f"tokenizer config {config_path}: added_tokens_decoder entry "
                             f"{key!r} is not 'id: {{\"content\": name}}'")
      if not base <= int(key) < base + TIKTOKEN_SPECIAL_SLOTS:
        raise TokenizerError(
            f"tokenizer config {config_path}: added_tokens_decoder id {key} lies outside the "
            f"special slots [{base}, {base + TIKTOKEN_SPECIAL_SLOTS}) after the "
            f"{base} ranks of {path}")
      named[name] = int(key)
    slots = range(base, base + TIKTOKEN_SPECIAL_SLOTS)
    used = set(named.values())
    free = [i for i in slots if i not in used]
    claimed = {n: i for n, i in named.items() if not RESERVED.match(n)}
    free = sorted(free + [i for n, i in named.items() if RESERVED.match(n)])
    names = {r: n for r, f in CONFIG_ROLE_FIELDS.items() if (n := token_name(config.get(f)))}
    role_ids, role_names, _ = assign_roles(
        roles_for(vision), specials=claimed, free=free, end=base + TIKTOKEN_SPECIAL_SLOTS,
        config_names=names, lookup=lambda n: None, where=config_path or path)
    # The vocabulary ends after the last id in use: unnamed reserved slots past it need no
    # embedding rows (Kimi's 163840-row table holds its named specials).
    size = max([base - 1, *named.values(), *role_ids.values()]) + 1
    special = special_mask(size, range(base, size))
    self._enc = lib.Encoding(name=os.path.basename(path), pat_str=KIMI_PATTERN,
                             mergeable_ranks=ranks, special_tokens={})
    self._ranks = ranks
    files = {TIKTOKEN_FILE: path} | ({CONFIG_FILE: config_path} if config_path else {})
    super().__init__(name=path, files=files, role_ids=role_ids, role_names=role_names,
                     special=special, vision=vision)

  def _body_encode(self, text: str) -> list[int]:
    return self._enc.encode_ordinary(text)

  def _body_decode(self, ids: list[int]) -> str:
    return self._enc.decode_bytes(ids).decode("utf-8", errors="replace")

  def _body_bytes(self) -> np.ndarray:
    out = np.zeros(len(self._ranks), np.int32)
    for token, rank in self._ranks.items():
      out[rank] = len(token)
    return out
