"""Document sources: random-access sequences of str for `grain.MapDataset.source`.

A source has `__len__` and `__getitem__(i) -> str`. Sources index their input once on
construction and keep only small metadata (paths, byte offsets, line numbers), so they
pickle cheaply into grain workers and read each document on demand.

Bad records are judged in one place, `BadRecords` (with `parse_jsonl_line` / `text_problem`),
at indexing time (before training starts), as `data.bad_records` says: "skip" (default)
leaves them out of the index and counts them (one warning line per file or text source,
with counts per reason and the first locations); "error" raises `BadRecordError` at the
first, naming the file, the line and what is wrong. Bad: JSONL lines that are not valid
UTF-8, not JSON (a truncated last line, nesting too deep), not an object, or without a
string `field`; text files that are not valid UTF-8; any document that is empty /
whitespace only or holds a lone surrogate (a JSON "\\ud800" escape, not encodable as UTF-8).
NUL and other control characters are legal text and kept; blank JSONL lines are ignored.

A skipped record never enters the index, so the document order, shuffle, held-out split and
iterator states are those of a file without it: a resumed run sees the batches an
uninterrupted one sees. An unreadable file (permission denied) raises in both modes:
skipping it would make the document set depend on the machine. A record that turns bad
after indexing (the file was edited) is skipped by `SafeSource` in the pipelines (or raises
in "error" mode), never a crash inside a grain worker.
"""

from __future__ import annotations

import collections
import os
import pathlib
from collections.abc import Iterable, Sequence

from absl import logging
import numpy as np

from hybridmoe_jax.data import long_docs, storage
# The bad-record rules live in bad_records.py; re-exported here for callers of sources.
from hybridmoe_jax.data.bad_records import (  # noqa: F401
    BadRecordError, BadRecords, check_index, decode_utf8, parse_jsonl_line, text_problem)
from hybridmoe_jax.config.run import DataConfig

PathLike = str | os.PathLike
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
      found = sorted(map(pathlib.Path, storage.walk(path, suffixes)))
      if not found:
        wanted = "files" if suffixes is None else "/".join(f"*{s}" for s in suffixes) + " files"
        raise ValueError(f"data directory {str(path)!r} contains no {wanted}")
      files.extend(found)
    else:
      raise FileNotFoundError(f"data path {str(path)!r} does not exist")
  return files


def _unreadable(path: PathLike, e: OSError) -> ValueError:
  return ValueError(f"{path}: cannot read the file ({e.strerror or e}); fix its permissions "
                    "or leave it out of data.paths")


def _open(path: PathLike):
  """open(path, "rb"); an unreadable file raises a one-line ValueError naming it (any mode)."""
  try:
    return open(path, "rb")
  except OSError as e:
    raise _unreadable(path, e) from e


def _read_bytes(path: PathLike) -> bytes:
  with _open(path) as f:
    try:
      return f.read()
    except OSError as e:  # e.g. EIO, or EISDIR for a directory named like a file
      raise _unreadable(path, e) from e


class BundledTextSource:
  """The help texts that ship with CPython (`pydoc_data.topics`), one document per topic.

  Needs no download, so the default run works offline. In CPython 3.11: 79 documents,
  466,117 UTF-8 bytes (see `len()` / `num_bytes` for this interpreter).
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

  def __len__(self) -> int:
    return len(self._docs)

  def __getitem__(self, i) -> str:
    return self._docs[check_index(i, len(self._docs))]


class TextFileSource:
  """One document per text file.

  Construction reads and decodes every file once (see the module docstring for bad files).

  Args:
    paths: files (taken whatever their name) and/or directories (searched recursively).
    suffixes: file-name endings taken inside directories; None takes every file.
    bad_records: "skip" (count and warn) or "error" (raise at the first bad file).

  Raises:
    FileNotFoundError: a path does not exist.
    BadRecordError: with bad_records="error", a file is not valid UTF-8 or is empty.
    ValueError: no files, a file cannot be read, or every file is bad.
  """

  def __init__(self, paths: PathLike | Iterable[PathLike], *,
               suffixes: tuple[str, ...] | None = TEXT_SUFFIXES, bad_records: str = "skip"):
    roots = _as_paths(paths)
    files = _list_files(roots, suffixes)
    bad = BadRecords(str([str(r) for r in roots]), bad_records, "text files")
    kept = []
    # Decoding every file once here is what lets bad input fail (or be counted) before
    # training instead of crashing a grain worker mid-run.
    for f in files:
      text, problem = decode_utf8(_read_bytes(f))
      problem = problem or text_problem(text)
      if problem:
        bad.add(str(f), problem)
      else:
        kept.append(str(f))
    bad.warn(len(files))
    if not kept:
      raise ValueError(f"no usable text in {[str(r) for r in roots]}: all {len(files)} files "
                       f"were skipped ({dict(bad.counts)})")
    self.files = tuple(kept)
    self.skipped = dict(bad.counts)

  def __len__(self) -> int:
    return len(self.files)

  def __getitem__(self, i) -> str:
    path = self.files[check_index(i, len(self.files))]
    text, problem = decode_utf8(_read_bytes(path))
    problem = problem or text_problem(text)
    if problem:  # the file changed after indexing
      raise BadRecordError(f"{path}: {problem[1]} (the file changed after it was indexed)")
    return text


class JsonlSource:
  """One document per JSON line: the string in `field` of each object.

  Construction reads every line once and keeps (file, byte offset, length, line number) of
  the good ones; blank lines are ignored, bad ones are skipped or raise (module docstring).

  Args:
    paths: .jsonl files (any name) and/or directories (searched for *.jsonl).
    field: the key holding the document text.
    bad_records: "skip" (count and warn per file) or "error" (raise at the first bad line).

  Attributes:
    lengths: int64 [n] bytes of each record's line (for the long-document upsampler).

  Raises:
    FileNotFoundError: a path does not exist.
    BadRecordError: with bad_records="error", the first bad line (file and line number).
    ValueError: no files, a file cannot be read, or no usable line in any of them.
  """

  def __init__(self, paths: PathLike | Iterable[PathLike], *, field: str = "text",
               bad_records: str = "skip"):
    roots = _as_paths(paths)
    self.files = tuple(str(f) for f in _list_files(roots, (".jsonl",)))
    self.field = field
    index = []  # (file id, byte offset, byte length, 1-based line number) per good line
    totals = collections.Counter()
    for k, path in enumerate(self.files):
      bad = BadRecords(path, bad_records, "lines")
      bad.warn(self._index_file(k, path, bad, index))
      totals.update(bad.counts)
    if not index:
      raise ValueError(f"no usable JSONL records with a non-empty string {field!r} field in "
                       f"{list(self.files)} (skipped: {dict(totals)})")
    self.skipped = dict(totals)
    cols = np.asarray(index, np.int64).T
    self._file_ids = cols[0].astype(np.int32)
    self._offsets, self.lengths, self._line_numbers = cols[1], cols[2], cols[3]

  def _index_file(self, k: int, path: str, bad: BadRecords, index: list) -> int:
    """Appends the good lines of file `k` to `index`; returns the number of non-blank lines."""
    offset = n_records = 0
    with _open(path) as f:
      # Streams: only one line (however long) is in memory at a time. Lines end at b"\n"
      # only, as in JSONL; a stray b"\r" is JSON whitespace or, inside a string, text.
      for line_number, line in enumerate(f, 1):
        start, offset = offset, offset + len(line)
        if not line.strip():
          continue
        n_records += 1
        _, problem = parse_jsonl_line(line, self.field)
        if problem:
          bad.add(f"{path} line {line_number}", problem)
        else:
          index.append((k, start, len(line), line_number))
    return n_records

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, i) -> str:
    i = check_index(i, len(self._offsets))
    path = self.files[self._file_ids[i]]
    with _open(path) as f:
      f.seek(int(self._offsets[i]))
      text, problem = parse_jsonl_line(f.read(int(self.lengths[i])), self.field)
    if problem:  # the file changed after indexing
      raise BadRecordError(f"{path} line {self._line_numbers[i]}: {problem[1]} (the file "
                           "changed after it was indexed)")
    return text


class SafeSource:
  """Wraps a source for a pipeline: a document that fails to load gives None (filtered).

  Covers files that vanish, become unreadable or are edited after the source was indexed,
  and text no tokenizer can take (`text_problem`, e.g. a lone surrogate from a Python-built
  source), so a bad document never crashes a grain worker: it is skipped with a counted
  warning (counts are per process; each grain worker counts its own) in either
  data.bad_records mode; "error" acts at indexing, before training. The outcome depends only
  on the document, so a resumed run skips exactly what the uninterrupted run skipped (and
  grain's filter keeps its parent's iterator state).
  """

  def __init__(self, source: Sequence[str], name: str = "source"):
    self.source, self.name = source, name
    self.failures: collections.Counter[str] = collections.Counter()

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, i) -> str | None:
    try:
      text = self.source[i]
    except (OSError, UnicodeError, ValueError, KeyError, TypeError) as e:
      problem = (type(e).__name__, f"{type(e).__name__}: {str(e)[:300]}")
    else:  # prepared token records (record_sources.py) arrive as int32 arrays
      problem = None if isinstance(text, np.ndarray) else text_problem(text)
    if problem is None:
      return text
    self.failures[problem[0]] += 1
    logging.warning("data source %r: skipped document %d (%s); %d skipped so far", self.name,
                    int(i), problem[1], sum(self.failures.values()))
    return None


class SubsetSource:
  """The documents of `parent` at `indices` (a view; nothing is copied)."""

  def __init__(self, parent: Sequence[str], indices: np.ndarray):
    self.parent = parent
    self.indices = np.asarray(indices, np.int64)

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, i) -> str:
    return self.parent[int(self.indices[check_index(i, len(self.indices))])]


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


def make_source(kind: str, paths: Sequence[str] = (), field: str = "text",
                bad_records: str = "skip"):
  """THE document-source factory (the `data` section, every named curriculum source):
  "bundled" (pydoc help texts), "stdlib_long" (standard-library packages; paths[0], if
  given, is another root), "text" or "jsonl" (files or directories; `field` is the JSON key
  of the text), "arrayrecord" (text or prepared token shards) or "parquet" (`field` is the
  text column): files, directories or globs, local or gs:// (record_sources.py).
  `bad_records` ("skip" or "error", data.bad_records): see `BadRecords`."""
  if kind in ("arrayrecord", "parquet"):
    from hybridmoe_jax.data import record_sources  # pylint: disable=g-import-not-at-top
    if kind == "arrayrecord":
      return record_sources.ArrayRecordSource(list(paths), bad_records=bad_records)
    return record_sources.ParquetSource(list(paths), field=field, bad_records=bad_records)
  remote = [p for p in paths if "://" in str(p)]
  if remote and kind in ("text", "jsonl"):
    raise ValueError(f"data.paths {remote[0]!r}: {kind} sources read local files only; make "
                     "ArrayRecord shards with `python -m hybridmoe_jax.data.prepare` (gs:// "
                     "works there) or use data.source='parquet'")
  if kind == "bundled":
    return BundledTextSource()
  if kind == "stdlib_long":
    return long_docs.StdlibLongDocSource(paths[0] if paths else None)
  if kind == "text":
    return TextFileSource(list(paths), bad_records=bad_records)
  if kind == "jsonl":
    return JsonlSource(list(paths), field=field, bad_records=bad_records)
  raise ValueError(f"unknown document source kind {kind!r}")


def source_from_config(cfg: DataConfig):
  """The document source the (validated) `data` section names."""
  return make_source(cfg.source, cfg.paths, cfg.jsonl_field, cfg.bad_records)
