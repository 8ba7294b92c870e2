"""The one document-source factory: a source kind (+ paths) -> an indexed document source.

Used for the `data` section (`source_from_config`) and for every named curriculum source
(`data/curriculum.py`); the sections themselves are typed in `hybridmoe_jax.run_config`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridmoe_jax.data import long_docs
from hybridmoe_jax.data import sources
from hybridmoe_jax.run_config import DataConfig


def make_source(kind: str, paths: Sequence[str] = (), field: str = "text",
                bad_records: str = "skip"):
  """Builds (indexes) a document source: "bundled" (pydoc help texts), "stdlib_long"
  (standard-library packages; paths[0], if given, is another root), "text" or "jsonl"
  (files or directories; `field` is the JSON key of the text). `bad_records` ("skip" or
  "error", data.bad_records) says what a bad text file or JSONL line does (sources.py)."""
  if kind == "bundled":
    return sources.BundledTextSource()
  if kind == "stdlib_long":
    return long_docs.StdlibLongDocSource(paths[0] if paths else None)
  if kind == "text":
    return sources.TextFileSource(list(paths), bad_records=bad_records)
  if kind == "jsonl":
    return sources.JsonlSource(list(paths), field=field, bad_records=bad_records)
  raise ValueError(f"unknown document source kind {kind!r}")


def source_from_config(cfg: DataConfig):
  """The document source the (validated) `data` section names."""
  return make_source(cfg.source, cfg.paths, cfg.jsonl_field, cfg.bad_records)
