"""The RULER-style suite's haystack: CPython's bundled prose, which no training source reads.

Held out BY SOURCE, not by seed. Training reads `pydoc_data.topics` (the "bundled" source, and
the retrieval documents' hay, `data.retrieval`), the standard library's *.py files
("stdlib_long": `data.long_docs` takes only .py files), and whatever text/jsonl files a config
names. The files below are the non-code prose of the standard library (the IDLE manual and
change logs, the email package's design notes): none is a .py file, none is in
pydoc_data, and the package layering keeps `hybridmoe_jax.data` (the training side) from
importing this module at all. `tests/evals/test_ruler_text.py` checks that no sentence of them
occurs in the training corpora.

Two splits, again by file: "validation" (choose a recipe on it) and "test" (report it; never
tune on it). Which files exist depends on the interpreter build (some distributions package
IDLE apart); the result records each split's files and a SHA-256 of its text
(`corpus_info`), so two figures are comparable only when those agree.
"""

from __future__ import annotations

import functools
import hashlib
import html.parser
import pathlib
import re
import sysconfig

SPLITS = ("validation", "test")
# Paths relative to the standard library directory.
FILES = {
    "validation": ("idlelib/NEWS2x.txt", "idlelib/TODO.txt", "idlelib/ChangeLog"),
    "test": ("idlelib/help.html", "idlelib/NEWS.txt", "email/architecture.rst"),
}
# Left out because the overlap test (13-word shingles against the training text) found
# their text in standard-library .py files, which the stdlib_long source trains on:
# LICENSE.txt (permission notices copied into module headers), idlelib/HISTORY.txt (the
# shell's usage text), idlelib/README.txt and extend.txt (menu listings and code).
MAX_FILE_BYTES = 1 << 20     # the files are ~3-80 KB; anything far larger is not them
MIN_SPLIT_CHARS = 20_000     # below this a 64K haystack would be mostly repeats
_WORD = re.compile(r"\b[a-z]{4,12}\b")   # whole words only (not a long word's prefix)
_RULE = re.compile(r"([=\-*~#_+])\1{3,}")


class _HtmlText(html.parser.HTMLParser):
  """The visible text of an HTML page (script/style dropped), block ends as newlines."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.parts: list[str] = []
    self._skip = 0

  def handle_starttag(self, tag, attrs):
    self._skip += tag in ("script", "style")

  def handle_endtag(self, tag):
    self._skip -= tag in ("script", "style") and self._skip > 0
    if tag in ("p", "li", "dd", "dt", "h1", "h2", "h3", "h4", "pre", "div", "tr"):
      self.parts.append("\n")

  def handle_data(self, data):
    if not self._skip:
      self.parts.append(data)


def _read(path: pathlib.Path) -> str:
  """A file's text (invalid UTF-8 replaced; HTML reduced to its visible text); '' when the
  file is absent, unreadable or implausibly large."""
  try:
    if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
      return ""
    text = path.read_bytes().decode("utf-8", errors="replace")
  except OSError:
    return ""
  if path.suffix == ".html":
    parser = _HtmlText()
    parser.feed(text)
    text = "".join(parser.parts)
  return text


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"ruler split must be one of {SPLITS}, got {split!r}")


@functools.lru_cache(maxsize=None)
def documents(split: str) -> tuple[tuple[str, str], ...]:
  """((relative path, text), ...) of `split`'s files that this interpreter has.

  Raises:
    ValueError: the split's files hold under MIN_SPLIT_CHARS characters (a stripped build).
  """
  _check_split(split)
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  docs = tuple((rel, t) for rel in FILES[split] if (t := _read(root / rel)).strip())
  if sum(len(t) for _, t in docs) < MIN_SPLIT_CHARS:
    raise ValueError(f"the ruler {split} haystack needs CPython's bundled prose files "
                     f"({', '.join(FILES[split])} under {root}); this interpreter has "
                     f"{[r for r, _ in docs]}: install the full standard library (with idlelib)")
  return docs


def split_sentences(text: str, max_chars: int = 300) -> list[str]:
  """Whitespace-normalised sentences of `text`, each ending in one space; a run longer than
  max_chars (a table, a list) is cut at spaces into pieces of at most max_chars."""
  # Rules of ====/---- (section underlines, shared with code comments) are decoration.
  flat = " ".join(_RULE.sub(" ", text).split())
  out = []
  for s in re.split(r"(?<=[.!?])\s+", flat):
    while len(s) > max_chars:
      cut = s.rfind(" ", 0, max_chars)
      cut = cut if cut > 0 else max_chars
      out.append(s[:cut].strip())
      s = s[cut:].strip()
    if s:
      out.append(s)
  return [s + " " for s in out if s]


@functools.lru_cache(maxsize=None)
def sentences(split: str) -> tuple[str, ...]:
  """Every sentence of the split's files in file order (the haystack reads them in a run,
  as an essay is read, starting at a random one)."""
  return tuple(s for _, t in documents(split) for s in split_sentences(t))


@functools.lru_cache(maxsize=None)
def vocabulary(split: str) -> tuple[str, ...]:
  """Distinct lower-case alphabetic words of 4-12 letters in the split, sorted (the words of
  word-shaped keys and of common-words extraction)."""
  words = set()
  for _, t in documents(split):
    words.update(_WORD.findall(t.lower()))
  return tuple(sorted(words))


def corpus_info(split: str) -> dict:
  """What the figures were measured on: files, characters, sentences and SHA-256 of the text."""
  docs = documents(split)
  digest = hashlib.sha256("\0".join(t for _, t in docs).encode("utf-8")).hexdigest()
  return {"split": split, "source": "CPython standard-library prose (not .py, not pydoc_data)",
          "files": [r for r, _ in docs], "chars": sum(len(t) for _, t in docs),
          "sentences": len(sentences(split)), "sha256": digest}
