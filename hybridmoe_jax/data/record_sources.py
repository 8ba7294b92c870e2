"""Sharded record formats as document sources: ArrayRecord (text or prepared tokens), Parquet.

Both are random access (`__len__`, `__getitem__`) over one or more files named by paths,
directories (walked, sorted) or globs, local or gs:// (`storage.py`), so grain shuffles,
shards per host and resumes them like the text and JSONL sources (`sources.py`).

ArrayRecord (`data.source = "arrayrecord"`, files *.array_record), read through grain's
`ArrayRecordDataSource` (remote shards are copied to a local cache first: the reader needs a
local file). A record is either
  - the UTF-8 text of one document (any ArrayRecord file), judged by `data.bad_records` at
    indexing like a JSONL line (every record is read once), or
  - with an `index.json` of format TOKENS_FORMAT next to the shards (written by
    `python -m hybridmoe_jax.data.prepare`): int32 little-endian token ids [BOS, ..., EOS] of
    one document, already tokenized; the pipelines pass them through without re-tokenizing,
    and `check_tokenizer` refuses a run whose tokenizer is not the one recorded.
Parquet (`data.source = "parquet"`, files *.parquet): one document per row, the string in
column `data.jsonl_field`; rows that are null, not strings, empty or not UTF-8-encodable are
bad records (skipped and counted, or an error naming file, row group and row). Reads are one
row group at a time, the last one cached per process.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from hybridmoe_jax.data import bad_records as sources_lib
from hybridmoe_jax.data import storage

ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
PARQUET_SUFFIXES = (".parquet",)
TOKENS_INDEX = "index.json"
TOKENS_FORMAT = "hybridmoe_jax.tokens/1"
TOKEN_DTYPE = np.dtype("<i4")


def decode_tokens(record: bytes) -> np.ndarray:
  """A prepared record -> int32 [n] token ids (n >= 2: BOS and EOS at least).

  Raises:
    ValueError: not a whole number of int32 ids, or fewer than 2 (one line).
  """
  if len(record) % TOKEN_DTYPE.itemsize or len(record) < 2 * TOKEN_DTYPE.itemsize:
    raise ValueError(f"token record of {len(record)} bytes is not 2 or more int32 ids")
  return np.frombuffer(record, TOKEN_DTYPE).astype(np.int32)


def encode_tokens(ids: np.ndarray) -> bytes:
  """int32 [n] token ids -> the record bytes `decode_tokens` reads."""
  return np.asarray(ids).astype(TOKEN_DTYPE).tobytes()


def read_index(directory) -> dict[str, Any] | None:
  """The prepared index.json in `directory` (local or gs://), or None when there is none.

  Raises:
    ValueError: an index.json that is not a JSON object of TOKENS_FORMAT (one line).
  """
  path = storage.as_path(directory) / TOKENS_INDEX
  try:
    if not path.exists():
      return None
    raw = path.read_text()
  except Exception as e:  # pylint: disable=broad-except
    raise storage.storage_error(str(path), e) from None
  try:
    index = json.loads(raw)
  except ValueError as e:
    raise ValueError(f"{path}: not valid JSON ({e}); rerun data.prepare") from None
  if not isinstance(index, dict) or index.get("format") != TOKENS_FORMAT:
    raise ValueError(f"{path}: not a prepared-shard index (format "
                     f"{index.get('format') if isinstance(index, dict) else None!r}, "
                     f"expected {TOKENS_FORMAT!r})")
  return index


def _prepared_info(files: list[str]) -> dict[str, Any] | None:
  """{"tokenizer", "documents": {file: n}} when every file is a prepared shard, else None."""
  dirs = sorted({str(storage.as_path(f).parent) for f in files})
  indexes = {d: read_index(d) for d in dirs}
  for d, ix in indexes.items():
    if ix is None and (storage.as_path(d) / "prepare.json").exists():
      raise ValueError(f"{d}: an unfinished data.prepare (prepare.json but no "
                       f"{TOKENS_INDEX}); rerun the same prepare command to complete it")
  have = [d for d, ix in indexes.items() if ix is not None]
  if not have:
    return None
  if len(have) != len(dirs):
    raise ValueError(f"data.paths mixes prepared token shards ({have[0]}) with text "
                     f"ArrayRecord files ({[d for d in dirs if d not in have][0]})")
  tokenizers = {json.dumps(ix.get("tokenizer"), sort_keys=True) for ix in indexes.values()}
  if len(tokenizers) > 1:
    raise ValueError(f"data.paths holds shards prepared with {len(tokenizers)} different "
                     f"tokenizers ({', '.join(dirs)})")
  counts = {}
  for d, ix in indexes.items():
    for shard in ix.get("shards", []):
      counts[str(storage.as_path(d) / shard["file"])] = int(shard["documents"])
  # Looked up by the path's normal form: a glob keeps its "./" ("./shards/x"), the index's
  # directory does not ("shards/x").
  documents = {f: counts.get(str(storage.as_path(f))) for f in files}
  missing = [f for f, n in documents.items() if n is None]
  if missing:
    raise ValueError(f"{missing[0]}: not listed in its directory's {TOKENS_INDEX} (an "
                     "unfinished prepare? rerun it to complete the set)")
  return {"tokenizer": json.loads(tokenizers.pop()), "documents": documents}


class ArrayRecordSource:
  """Documents in ArrayRecord files: text records, or prepared token records (module doc).

  Args:
    paths: files, directories (searched for *.array_record) or globs; local or gs://.
    bad_records: "skip" or "error" for text records (`sources.BadRecords`).

  Attributes:
    tokenizer_fingerprint: the prepared shards' tokenizer (`tokenizer.fingerprint`), or None
      for text records.
    files: the shard paths as listed (remote ones keep their gs:// name).

  Raises:
    FileNotFoundError / ValueError / OSError: no files, a shard that does not match its
      index, no usable record, storage failures; each one line naming the path.
  """

  def __init__(self, paths: str | Iterable[str], *, bad_records: str = "skip"):
    import grain  # pylint: disable=g-import-not-at-top
    try:
      from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError as e:
      raise ImportError("data.source='arrayrecord' needs the array-record package: pip "
                        "install -e '.[data]'") from e
    self.files = tuple(storage.list_files(paths, ARRAY_RECORD_SUFFIXES))
    info = _prepared_info(list(self.files))
    local = [storage.local_copy(f) for f in self.files]
    self._source = grain.sources.ArrayRecordDataSource(local)
    self.tokenizer_fingerprint = info["tokenizer"] if info else None
    self._keep = None   # int64 [n] record ids of the good records; None: all of them
    self._lengths = None
    self.skipped: dict[str, int] = {}
    if info:
      self._check_counts(local, info["documents"])
    else:
      self._index_text(local, bad_records)

  def _check_counts(self, local: list[str], counts: dict[str, int]) -> None:
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    for name, path in zip(self.files, local):
      reader = array_record_module.ArrayRecordReader(path)
      n = reader.num_records()
      reader.close()
      if n != counts[name]:
        raise ValueError(f"{name}: holds {n} records, its {TOKENS_INDEX} says {counts[name]} "
                         "(a shard from another prepare run?); rerun data.prepare")

  def _index_text(self, local: list[str], bad_records: str) -> None:
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    keep, total = [], 0
    bad = sources_lib.BadRecords(str(list(self.files)), bad_records, "records")
    for name, path in zip(self.files, local):
      reader = array_record_module.ArrayRecordReader(path)
      n = reader.num_records()
      # Reading every record once is what lets bad input fail (or be counted) before training.
      for start in range(0, n, 4096):
        for k, record in enumerate(reader.read(start, min(n, start + 4096))):
          text, problem = sources_lib.decode_utf8(record)
          problem = problem or sources_lib.text_problem(text)
          if problem:
            bad.add(f"{name} record {start + k}", problem)
          else:
            keep.append(total + start + k)
      reader.close()
      total += n
    bad.warn(total)
    if not keep:
      raise ValueError(f"no usable text records in {list(self.files)} (skipped: "
                       f"{dict(bad.counts)})")
    self.skipped = dict(bad.counts)
    if len(keep) < total:
      self._keep = np.asarray(keep, np.int64)

  @property
  def tokenized(self) -> bool:
    return self.tokenizer_fingerprint is not None

  def __len__(self) -> int:
    return len(self._source) if self._keep is None else len(self._keep)

  def __getitem__(self, i) -> str | np.ndarray:
    i = sources_lib.check_index(i, len(self))
    record = self._source[i if self._keep is None else int(self._keep[i])]
    if self.tokenized:
      return decode_tokens(record)
    text, problem = sources_lib.decode_utf8(record)
    problem = problem or sources_lib.text_problem(text)
    if problem:  # the file changed after indexing
      raise sources_lib.BadRecordError(f"record {i}: {problem[1]} (changed after indexing)")
    return text

  @property
  def lengths(self) -> np.ndarray:
    """int64 [n]: record bytes (for prepared shards: 4 per token), for the long-document
    upsampler; read once on first use."""
    if self._lengths is None:
      self._lengths = np.asarray([len(self._source[int(j)]) for j in (
          range(len(self)) if self._keep is None else self._keep)], np.int64)
    return self._lengths


class ParquetSource:
  """One document per Parquet row: the string in column `field` (module docstring).

  Args:
    paths: files, directories (searched for *.parquet) or globs; local or gs://.
    field: the text column (data.jsonl_field).
    bad_records: "skip" or "error" (`sources.BadRecords`).

  Raises:
    ImportError: pyarrow is not installed (the `data` extra).
    ValueError: a file without the column, no usable row; FileNotFoundError / OSError: paths.
  """

  def __init__(self, paths: str | Iterable[str], *, field: str = "text",
               bad_records: str = "skip"):
    pq = _pyarrow_parquet()
    self.files = tuple(storage.list_files(paths, PARQUET_SUFFIXES))
    self.field = field
    index, totals = [], {}
    for k, path in enumerate(self.files):
      bad = sources_lib.BadRecords(path, bad_records, "rows")
      with storage.open_read(path) as f:
        try:
          pf = pq.ParquetFile(f)
        except Exception as e:  # pylint: disable=broad-except  # pyarrow's ArrowInvalid etc.
          raise ValueError(f"{path}: not a readable Parquet file ({str(e)[:200]})") from None
        names = pf.schema_arrow.names
        if field not in names:
          raise ValueError(f"{path}: no column {field!r} (data.jsonl_field); columns: {names}")
        rows = 0
        for g in range(pf.num_row_groups):
          values = pf.read_row_group(g, columns=[field]).column(0).to_pylist()
          for r, text in enumerate(values):
            problem = (("null text", "the text is null") if text is None
                       else sources_lib.text_problem(text))
            if problem:
              bad.add(f"{path} row group {g} row {r}", problem)
            else:
              index.append((k, g, r, len(text.encode("utf-8"))))
          rows += len(values)
      bad.warn(rows)
      for reason, n in bad.counts.items():
        totals[reason] = totals.get(reason, 0) + n
    if not index:
      raise ValueError(f"no usable rows with a non-empty string {field!r} column in "
                       f"{list(self.files)} (skipped: {totals})")
    self.skipped = totals
    cols = np.asarray(index, np.int64).T
    self._file_ids, self._groups, self._rows = cols[0].astype(np.int32), cols[1], cols[2]
    self.lengths = cols[3]
    self._cache: tuple[tuple[int, int], list] | None = None

  def __getstate__(self):  # grain workers: no cached row group in the pickle
    return {**self.__dict__, "_cache": None}

  def __len__(self) -> int:
    return len(self._rows)

  def __getitem__(self, i) -> str:
    i = sources_lib.check_index(i, len(self._rows))
    key = (int(self._file_ids[i]), int(self._groups[i]))
    if self._cache is None or self._cache[0] != key:
      path = self.files[key[0]]
      with storage.open_read(path) as f:
        group = _pyarrow_parquet().ParquetFile(f).read_row_group(key[1], columns=[self.field])
      self._cache = (key, group.column(0).to_pylist())
    text = self._cache[1][int(self._rows[i])]
    problem = (("null text", "the text is null") if text is None
               else sources_lib.text_problem(text))
    if problem:  # the file changed after indexing
      raise sources_lib.BadRecordError(f"{self.files[key[0]]} row group {key[1]} row "
                                       f"{self._rows[i]}: {problem[1]} (changed after indexing)")
    return text


def _pyarrow_parquet():
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("data.source='parquet' needs pyarrow: pip install -e '.[data]'") from e
  return pq


def prepared_fingerprint(source) -> dict[str, Any] | None:
  """The tokenizer fingerprint of prepared shards under `source` (through subset / safe /
  indexed views), or None for a text source."""
  seen = 0
  while source is not None and seen < 16:
    fp = getattr(source, "tokenizer_fingerprint", None)
    if fp is not None:
      return fp
    source = getattr(source, "parent", None) or getattr(source, "source", None)
    seen += 1
  return None


def check_tokenizer(source, tokenizer, fingerprint_fn, name: str = "data") -> None:
  """Refuses prepared shards made with another tokenizer than the run's (one line).

  fingerprint_fn: `tokenizer.fingerprint` (passed in: the fingerprint hashes tokenizer files).
  """
  want = prepared_fingerprint(source)
  if want is None:
    return
  have = fingerprint_fn(tokenizer)
  if want != have:
    def short(fp):
      files = ",".join(f"{k} {v[:12]}" for k, v in sorted(fp.get("files", {}).items()))
      chat = " chat" if fp.get("chat") else ""
      return (f"{fp.get('kind')}{chat}, {fp.get('vocab_size')} ids"
              + (f" ({files})" if files else ""))
    raise ValueError(f"{name}: the shards were prepared with another tokenizer ({short(want)}) "
                     f"than data.tokenizer ({short(have)}); rerun data.prepare with "
                     "--tokenizer=<this run's> or set data.tokenizer to the shards' one")
