"""Document sources: random-access sequences of str for `grain.MapDataset.source`.

A source has `__len__` and `__getitem__(i) -> str`, one document per index. Sources index
their input once on construction and keep only small metadata (paths, byte offsets), so they
pickle cheaply into grain worker processes and read each document on demand. Unusable input
(bad UTF-8, malformed JSONL lines, empty documents) is skipped with one counted warning per
file; input that leaves nothing usable raises before training starts.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Union

from absl import logging
import numpy as np

PathLike = Union[str, os.PathLike]
TEXT_SUFFIXES = (".txt", ".md")


def _as_paths(paths: PathLike | Iterable[PathLike]) -> list[pathlib.Path]:
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  out = [pathlib.Path(p).expanduser() for p in paths]
  if not out:
    raise ValueError("no data paths given")
  return out


def _list_files(paths: Sequence[pathlib.Path],
                suffixes: tuple[str, ...] | None) -> list[pathlib.Path]:
  """Named files as given; directories walked recursively in sorted order.

  Inside directories only names ending in `suffixes` are taken (all when None), and hidden
  entries (".git", ".DS_Store") are ignored. Sorting makes the document order, and so the
  shuffle and the held-out split, independent of the file system's listing order.
  """
  files = []
  for path in paths:
    if path.is_file():
      files.append(path)
    elif path.is_dir():
      found = sorted(
          p for p in path.rglob("*")
          if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
          and (suffixes is None or p.name.endswith(suffixes)))
      if not found:
        wanted = "files" if suffixes is None else "/".join(f"*{s}" for s in suffixes) + " files"
        raise ValueError(f"data directory {str(path)!r} contains no {wanted}")
      files.extend(found)
    else:
      raise FileNotFoundError(f"data path {str(path)!r} does not exist")
  return files


def _check_index(i, n: int) -> int:
  i = int(i)  # grain may pass numpy integers
  if i < 0:
    i += n
  if not 0 <= i < n:
    raise IndexError(f"document index {i} out of range for {n} documents")
  return i


def _warn_skipped(kind: str, where: str, skipped: collections.Counter, total: int) -> None:
  if skipped:
    detail = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
    logging.warning("%s: skipped %d of %d %s (%s)", kind, sum(skipped.values()), total, where,
                    detail)


class BundledTextSource:
  """The help texts that ship with CPython (`pydoc_data.topics`), one document per topic.

  Needs no download, so the default run works offline. In CPython 3.11: 79 documents,
  466,117 UTF-8 bytes (see `num_documents` / `num_bytes` for this interpreter).
  """

  def __init__(self):
    try:
      from pydoc_data import topics  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ValueError("the bundled corpus needs CPython's `pydoc_data` module, which this "
                       "interpreter lacks; use data.source='text' or 'jsonl'") from e
    names = sorted(k for k, v in topics.topics.items() if v.strip())
    if not names:
      raise ValueError("pydoc_data.topics holds no text")
    self.names = tuple(names)
    self._docs = tuple(topics.topics[k] for k in names)
    self.num_bytes = sum(len(d.encode("utf-8")) for d in self._docs)
    logging.info("BundledTextSource: %d documents, %d bytes", len(self), self.num_bytes)

  @property
  def num_documents(self) -> int:
    return len(self._docs)

  def __len__(self) -> int:
    return len(self._docs)

  def __getitem__(self, i) -> str:
    return self._docs[_check_index(i, len(self._docs))]


class TextFileSource:
  """One document per text file.

  Args:
    paths: files (taken whatever their name) and/or directories (searched recursively).
    suffixes: file-name endings taken inside directories; None takes every file.

  Raises:
    FileNotFoundError: a path does not exist.
    ValueError: no files, or every file is empty or not valid UTF-8.
  """

  def __init__(self, paths: PathLike | Iterable[PathLike], *,
               suffixes: tuple[str, ...] | None = TEXT_SUFFIXES):
    roots = _as_paths(paths)
    files = _list_files(roots, suffixes)
    kept, skipped = [], collections.Counter()
    # Decoding every file once here is what lets bad input fail (or be counted) before
    # training instead of crashing a grain worker mid-run.
    for f in files:
      try:
        text = f.read_bytes().decode("utf-8")
      except UnicodeDecodeError:
        skipped["not valid UTF-8"] += 1
        continue
      if not text.strip():
        skipped["empty"] += 1
        continue
      kept.append(str(f))
    _warn_skipped("TextFileSource", f"files under {[str(r) for r in roots]}", skipped,
                  len(files))
    if not kept:
      raise ValueError(f"no usable text in {[str(r) for r in roots]}: all {len(files)} files "
                       f"were skipped ({dict(skipped)})")
    self.files = tuple(kept)
    self.skipped = dict(skipped)

  def __len__(self) -> int:
    return len(self.files)

  def __getitem__(self, i) -> str:
    return pathlib.Path(self.files[_check_index(i, len(self.files))]).read_text("utf-8")


class JsonlSource:
  """One document per JSON line: the string in `field` of each object.

  Construction reads every line once and keeps (file, byte offset, length) of the good ones;
  blank lines are ignored, and lines that are not JSON objects, are not valid UTF-8, lack a
  string `field`, or hold only whitespace are skipped and counted.

  Args:
    paths: .jsonl files (any name) and/or directories (searched for *.jsonl).
    field: the key holding the document text.

  Raises:
    FileNotFoundError: a path does not exist.
    ValueError: no files, or no usable line in any of them.
  """

  def __init__(self, paths: PathLike | Iterable[PathLike], *, field: str = "text"):
    roots = _as_paths(paths)
    self.files = tuple(str(f) for f in _list_files(roots, (".jsonl",)))
    self.field = field
    file_ids, offsets, lengths = [], [], []
    totals = collections.Counter()
    for k, path in enumerate(self.files):
      skipped, n_lines = self._index_file(path, k, file_ids, offsets, lengths)
      _warn_skipped("JsonlSource", f"lines in {path}", skipped, n_lines)
      totals.update(skipped)
    if not offsets:
      raise ValueError(f"no usable JSONL records with a non-empty string {field!r} field in "
                       f"{list(self.files)} (skipped: {dict(totals)})")
    self.skipped = dict(totals)
    self._file_ids = np.asarray(file_ids, np.int32)
    self._offsets = np.asarray(offsets, np.int64)
    self._lengths = np.asarray(lengths, np.int64)

  def _index_file(self, path, k, file_ids, offsets, lengths) -> tuple[collections.Counter, int]:
    skipped = collections.Counter()
    offset = n_lines = 0
    with open(path, "rb") as f:
      for line in f:
        start, offset = offset, offset + len(line)
        if not line.strip():
          continue
        n_lines += 1
        try:
          record = json.loads(line)  # bytes: invalid UTF-8 raises UnicodeDecodeError
        except ValueError:
          skipped["malformed (bad JSON or UTF-8)"] += 1
          continue
        text = record.get(self.field) if isinstance(record, dict) else None
        if not isinstance(text, str):
          skipped[f"without a string {self.field!r} field"] += 1
        elif not text.strip():
          skipped["empty text"] += 1
        else:
          file_ids.append(k)
          offsets.append(start)
          lengths.append(len(line))
    return skipped, n_lines

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, i) -> str:
    i = _check_index(i, len(self._offsets))
    with open(self.files[self._file_ids[i]], "rb") as f:
      f.seek(int(self._offsets[i]))
      return json.loads(f.read(int(self._lengths[i])))[self.field]


class SubsetSource:
  """The documents of `parent` at `indices` (a view; nothing is copied)."""

  def __init__(self, parent: Sequence[str], indices: np.ndarray):
    self.parent = parent
    self.indices = np.asarray(indices, np.int64)

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, i) -> str:
    return self.parent[int(self.indices[_check_index(i, len(self.indices))])]


def split_source(source: Sequence[str], heldout_fraction: float,
                 seed: int) -> tuple[SubsetSource, SubsetSource]:
  """Splits documents (never a document's pieces) into disjoint train / held-out sets.

  round(n * heldout_fraction) documents are held out, at least 1 and at most n - 1. The
  choice depends only on (len(source), heldout_fraction, seed), so keep `seed` fixed across
  runs that should be evaluated on the same documents.

  Returns:
    (train, heldout), each a SubsetSource with sorted `indices` into `source`.
  """
  n = len(source)
  if not 0.0 < heldout_fraction < 1.0:
    raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
  if n < 2:
    raise ValueError(f"need at least 2 documents to hold one out for evaluation, got {n}")
  n_heldout = min(n - 1, max(1, round(n * heldout_fraction)))
  order = np.random.default_rng(seed).permutation(n)
  return (SubsetSource(source, np.sort(order[n_heldout:])),
          SubsetSource(source, np.sort(order[:n_heldout])))
