"""Tokenize a corpus once into ArrayRecord shards that training reads without re-tokenizing.

    python -m hybridmoe_jax.data.prepare --input=corpus.jsonl --output=gs://bucket/shards \\
        --tokenizer=byte [--kind=jsonl|text|parquet|arrayrecord] [--field=text]

Documents are read in the order the same `data.source` would read them (the same sources,
the same bad-record policy: --bad_records), so a run on the shards sees the documents, the
held-out split and the batches of a run on the original files (same seed). Each record is
one document's int32 little-endian ids [BOS, ids..., EOS] (record_sources.encode_tokens).

Output (a local directory or gs://...):
  shard-NNNNN.array_record   --docs_per_shard documents each (the last one fewer)
  shard-NNNNN.json           written after its shard: documents, tokens, bytes
  prepare.json               the settings: input files, tokenizer fingerprint, shard size
  index.json                 written last: format, tokenizer fingerprint, documents, tokens,
                             and the shard list; training needs it (an unfinished set is
                             refused in one line)
Resumable: a killed prepare, rerun with the same arguments, keeps every shard whose .json
exists, rewrites the rest and ends with byte-identical files. Other settings than the
recorded prepare.json are refused (one line) rather than mixed into one set. A progress
line (documents, tokens, rate) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence

from hybridmoe_jax.data import record_sources
from hybridmoe_jax.data import sources as sources_lib
from hybridmoe_jax.data import storage
from hybridmoe_jax.data.tokenizers.load import fingerprint, make_tokenizer

SETTINGS = "prepare.json"
_KIND_BY_SUFFIX = {".jsonl": "jsonl", ".txt": "text", ".md": "text", ".parquet": "parquet",
                   **dict.fromkeys(record_sources.ARRAY_RECORD_SUFFIXES, "arrayrecord")}


def shard_name(k: int) -> str:
  return f"shard-{k:05d}.array_record"


def infer_kind(inputs: Sequence[str]) -> str:
  """The source kind from the inputs' suffixes (one line naming --kind when unclear)."""
  kinds = {_KIND_BY_SUFFIX.get(os.path.splitext(p.rstrip("*"))[1]) for p in inputs}
  if len(kinds) != 1 or None in kinds:
    raise ValueError(f"--kind: cannot tell the input kind of {list(inputs)} from the file "
                     f"names; pass --kind, one of {sorted(set(_KIND_BY_SUFFIX.values()))}")
  return kinds.pop()


class _Progress:
  """One progress line on stderr, rewritten in place on a terminal, at most once a second."""

  def __init__(self, total: int, stream=sys.stderr):
    self.total, self.stream, self.t0, self.last = total, stream, time.time(), 0.0
    self.tty = getattr(stream, "isatty", lambda: False)()

  def update(self, docs: int, tokens: int, shard: int, force: bool = False) -> None:
    now = time.time()
    if not force and now - self.last < 1.0:
      return
    self.last = now
    rate = tokens / max(now - self.t0, 1e-9)
    line = (f"prepare: {docs}/{self.total} documents ({100 * docs / max(self.total, 1):.1f}%), "
            f"{tokens} tokens, {rate:,.0f} tokens/s, shard {shard}")
    self.stream.write(("\r" + line) if self.tty else line + "\n")
    self.stream.flush()


def _write_json(path, obj) -> None:
  path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _read_json(path):
  try:
    return json.loads(path.read_text()) if path.exists() else None
  except ValueError:
    return None  # a torn sidecar (killed while writing): the shard is redone


def prepare(inputs: Sequence[str], output: str, tokenizer_spec: str, *, kind: str = "auto",
            field: str = "text", bad_records: str = "skip", docs_per_shard: int = 10_000,
            progress=sys.stderr, _die_after_shards: int | None = None) -> dict:
  """Writes the shards and index (module docstring); returns the index.

  Raises:
    ValueError: bad arguments (named), settings other than an earlier run's in `output`,
      no usable documents; OSError: storage failures (one line).
  """
  if docs_per_shard < 1:
    raise ValueError(f"--docs_per_shard={docs_per_shard} is invalid: allowed >= 1")
  kind = infer_kind(inputs) if kind == "auto" else kind
  if kind not in ("jsonl", "text", "parquet", "arrayrecord"):
    raise ValueError(f"--kind={kind!r} is invalid: allowed jsonl, text, parquet, arrayrecord")
  tok = make_tokenizer(tokenizer_spec)
  source = sources_lib.make_source(kind, list(inputs), field, bad_records)
  if record_sources.prepared_fingerprint(source) is not None:
    raise ValueError(f"--input {list(inputs)} already holds prepared token shards")
  out = storage.as_path(output)
  try:
    out.mkdir(parents=True, exist_ok=True)
  except Exception as e:  # pylint: disable=broad-except
    raise storage.storage_error(output, e, "write") from None
  settings = {"format": record_sources.TOKENS_FORMAT, "kind": kind, "field": field,
              "bad_records": bad_records, "inputs": list(getattr(source, "files", inputs)),
              "documents": len(source), "docs_per_shard": docs_per_shard,
              "tokenizer": fingerprint(tok)}
  saved = _read_json(out / SETTINGS)
  if saved is not None and saved != settings:
    diff = sorted(k for k in settings if saved.get(k) != settings[k])
    raise ValueError(f"--output {output} holds a prepare with other settings ({', '.join(diff)}"
                     "); use a new --output, or the original arguments to resume it")
  if saved is None:
    _write_json(out / SETTINGS, settings)
  n = len(source)
  num_shards = -(-n // docs_per_shard)
  shards, docs_done, tokens_done = [], 0, 0
  bar = _Progress(n, progress) if progress else None
  for k in range(num_shards):
    lo, hi = k * docs_per_shard, min(n, (k + 1) * docs_per_shard)
    meta = _read_json(out / f"{shard_name(k)[:-len('.array_record')]}.json")
    if not (meta and meta.get("documents") == hi - lo and (out / shard_name(k)).exists()
            and storage.file_size(str(out / shard_name(k))) == meta.get("bytes")):
      meta = _write_shard(source, tok, out, k, lo, hi,
                          die=_die_after_shards is not None and k >= _die_after_shards)
    shards.append({"file": shard_name(k), **meta})
    docs_done, tokens_done = hi, tokens_done + meta["tokens"]
    if bar:
      bar.update(docs_done, tokens_done, k)
  index = {"format": record_sources.TOKENS_FORMAT, "tokenizer": settings["tokenizer"],
           "documents": n, "tokens": tokens_done, "shards": shards,
           "skipped": dict(getattr(source, "skipped", {}) or {})}
  _write_json(out / record_sources.TOKENS_INDEX, index)
  if bar:
    bar.update(n, tokens_done, num_shards - 1, force=True)
    if bar.tty:
      progress.write("\n")
  return index


def _write_shard(source, tok, out, k: int, lo: int, hi: int, die: bool) -> dict:
  """Tokenizes documents [lo, hi) into shard k (local temp file, then moved or uploaded
  whole, so a shard under its final name is always complete); returns its sidecar."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  tokens = 0
  with tempfile.TemporaryDirectory(prefix="prepare_") as tmp:
    local = os.path.join(tmp, shard_name(k))
    # group_size:1: each record its own chunk, so a random read decodes one document only.
    writer = array_record_module.ArrayRecordWriter(local, "group_size:1")
    for i in range(lo, hi):
      ids = tok.encode(source[i], bos=True, eos=True)
      writer.write(record_sources.encode_tokens(ids))
      tokens += len(ids)
      if die and i == (lo + hi) // 2:  # test hook: a kill half-way through a shard
        os._exit(137)  # pylint: disable=protected-access
    writer.close()
    size = os.path.getsize(local)
    if storage.is_remote(str(out)):
      storage.upload(tmp, str(out), [shard_name(k)])   # one whole object; one-line errors
    else:
      try:
        os.replace(local, str(out / shard_name(k)))
      except OSError as e:
        raise storage.storage_error(str(out / shard_name(k)), e, "write") from None
  meta = {"documents": hi - lo, "tokens": tokens, "bytes": size}
  _write_json(out / f"{shard_name(k)[:-len('.array_record')]}.json", meta)
  return meta


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--input", nargs="+", required=True,
                      help="files, directories or globs (text / jsonl / parquet)")
  parser.add_argument("--output", required=True, help="directory or gs://bucket/dir")
  parser.add_argument("--tokenizer", default="byte", help="as data.tokenizer")
  parser.add_argument("--kind", default="auto", help="jsonl, text, parquet, arrayrecord")
  parser.add_argument("--field", default="text", help="JSON key / Parquet column of the text")
  parser.add_argument("--bad_records", default="skip", help="skip or error")
  parser.add_argument("--docs_per_shard", type=int, default=10_000)
  parser.add_argument("--debug_die_after_shards", type=int, default=None,
                      help=argparse.SUPPRESS)  # tests: die half-way through this shard
  args = parser.parse_args(argv)
  try:
    index = prepare(args.input, args.output, args.tokenizer, kind=args.kind, field=args.field,
                    bad_records=args.bad_records, docs_per_shard=args.docs_per_shard,
                    _die_after_shards=args.debug_die_after_shards)
  except (ValueError, OSError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {len(index['shards'])} shards to {args.output}: {index['documents']} "
        f"documents, {index['tokens']} tokens")
  return 0


if __name__ == "__main__":
  sys.exit(main())
