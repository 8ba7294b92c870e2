"""ArrayRecord and Parquet sources: random access, globs / directories of shards, the
bad-record policy, prepared token shards (`data.prepare`): byte-identical resume after a
kill, the tokenizer check, and batches equal to the JSONL pipeline's on the same text."""

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("array_record", reason="the data extra (array-record) is not installed")

from hybridmoe_jax.data import prepare as prepare_lib  # noqa: E402
from hybridmoe_jax.data import record_sources  # noqa: E402
from hybridmoe_jax.data import sources as sources_lib  # noqa: E402
from hybridmoe_jax.data.pipeline import build_train_and_eval, make_pipeline  # noqa: E402
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer  # noqa: E402
from hybridmoe_jax.config.run import DataConfig  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

TOK = ByteTokenizer()
DOCS = [f"document {i}: " + "lorem ipsum " * (1 + i % 9) for i in range(40)]
KEYS = ("tokens", "segment_ids", "positions")


def _jsonl(path, docs=DOCS, bad=()):
  lines = [json.dumps({"text": d}) for d in docs]
  for at, line in bad:
    lines.insert(at, line)
  path.write_text("\n".join(lines) + "\n")
  return path


def _text_records(path, records):
  from array_record.python import array_record_module
  w = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    w.write(r)
  w.close()
  return path


def _parquet(path, docs, rows_per_group=7):
  pa = pytest.importorskip("pyarrow", reason="the data extra (pyarrow) is not installed")
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), str(path),
                 row_group_size=rows_per_group)
  return path


def _batches(data_source, paths, n=4, **cfg):
  cfg = DataConfig(source=data_source, paths=tuple(str(p) for p in paths), **cfg)
  data = build_train_and_eval(cfg, vocab_size=TOK.vocab_size, seq_len=32, batch_size=4, seed=3)
  return [next(data.train) for _ in range(n)], data.eval_batches


def _same(a, b):
  return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)


def test_text_arrayrecord_glob_and_directory(tmp_path):
  half = len(DOCS) // 2
  _text_records(tmp_path / "a-0.array_record", [d.encode() for d in DOCS[:half]])
  _text_records(tmp_path / "a-1.array_record", [d.encode() for d in DOCS[half:]])
  by_glob = sources_lib.make_source("arrayrecord", [str(tmp_path / "a-*.array_record")])
  by_dir = sources_lib.make_source("arrayrecord", [str(tmp_path)])
  assert [by_glob[i] for i in range(len(DOCS))] == DOCS
  assert [by_dir[i] for i in (39, 0, 17)] == [DOCS[39], DOCS[0], DOCS[17]]  # random access
  assert by_glob.tokenizer_fingerprint is None


def test_text_arrayrecord_bad_records(tmp_path, caplog):
  recs = [d.encode() for d in DOCS[:5]] + [b"caf\xe9", b"  "] + [d.encode() for d in DOCS[5:8]]
  path = _text_records(tmp_path / "x.array_record", recs)
  src = sources_lib.make_source("arrayrecord", [str(path)])
  assert [src[i] for i in range(len(src))] == DOCS[:8]
  assert src.skipped == {"not valid UTF-8": 1, "empty text": 1}
  with pytest.raises(sources_lib.BadRecordError,
                     match=r"x.array_record record 5: not valid UTF-8 .*data.bad_records=skip"):
    sources_lib.make_source("arrayrecord", [str(path)], bad_records="error")


def test_parquet_row_groups_and_bad_rows(tmp_path):
  docs = DOCS[:10] + [None, ""] + DOCS[10:20]
  path = _parquet(tmp_path / "p.parquet", docs, rows_per_group=4)
  src = sources_lib.make_source("parquet", [str(tmp_path / "*.parquet")])
  want = DOCS[:20]
  assert len(src) == 20 and [src[i] for i in (19, 3, 4, 0, 11)] == [want[i] for i in
                                                                   (19, 3, 4, 0, 11)]
  assert src.skipped == {"null text": 1, "empty text": 1}
  with pytest.raises(sources_lib.BadRecordError, match="row group 2 row 2: the text is null"):
    sources_lib.make_source("parquet", [str(path)], bad_records="error")
  with pytest.raises(ValueError, match=r"no column 'body' \(data.jsonl_field\)"):
    sources_lib.make_source("parquet", [str(path)], field="body")


def test_missing_paths_one_line(tmp_path):
  with pytest.raises(FileNotFoundError, match="glob .* matches no"):
    sources_lib.make_source("arrayrecord", [str(tmp_path / "none-*.array_record")])
  with pytest.raises(ValueError, match="contains no \\*.parquet files"):
    sources_lib.make_source("parquet", [str(tmp_path)])
  with pytest.raises(ValueError, match="read local files only"):
    sources_lib.make_source("jsonl", ["gs://bucket/x.jsonl"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """The same text as JSONL (with a bad line), Parquet, and prepared shards of the JSONL."""
  d = tmp_path_factory.mktemp("corpus")
  jsonl = _jsonl(d / "c.jsonl", bad=[(7, "{not json")])
  parquet = _parquet(d / "c.parquet", DOCS)
  prepare_lib.prepare([str(jsonl)], str(d / "shards"), "byte", docs_per_shard=6, progress=None)
  return dict(jsonl=jsonl, parquet=parquet, shards=d / "shards")


def test_prepared_shards_hold_the_tokenized_documents(corpus):
  index = json.loads((corpus["shards"] / "index.json").read_text())
  assert index["documents"] == len(DOCS) and len(index["shards"]) == 7
  assert index["tokens"] == sum(len(d.encode()) + 2 for d in DOCS)
  assert index["tokenizer"]["kind"] == "ByteTokenizer" and index["skipped"] == {
      "malformed JSON": 1}
  src = sources_lib.make_source("arrayrecord", [str(corpus["shards"])])
  for i in (0, 13, 39):  # the slow reference: tokenize the text now
    np.testing.assert_array_equal(src[i], TOK.encode(DOCS[i], bos=True, eos=True))


@pytest.mark.parametrize("kind", ["shards", "parquet"])
def test_same_batches_as_jsonl(corpus, kind):
  """Same documents in the same order -> the same split, shuffle and packed batches as from
  the JSONL (so a run's losses are the same); resume from a state mid-way is exact."""
  ref, ref_eval = _batches("jsonl", [corpus["jsonl"]], n=6)
  got, got_eval = _batches("arrayrecord" if kind == "shards" else "parquet", [corpus[kind]],
                           n=6)
  assert _same(ref, got) and _same(ref_eval, got_eval)
  cfg = DataConfig(source="arrayrecord" if kind == "shards" else "parquet",
                   paths=(str(corpus[kind]),))
  data = build_train_and_eval(cfg, vocab_size=TOK.vocab_size, seq_len=32, batch_size=4, seed=3)
  for _ in range(2):
    next(data.train)
  state = data.train.get_state()
  again = build_train_and_eval(cfg, vocab_size=TOK.vocab_size, seq_len=32, batch_size=4,
                               seed=3).train
  again.set_state(json.loads(json.dumps(state)))
  assert _same([next(again) for _ in range(4)], ref[2:])


def test_shards_of_another_tokenizer_are_refused(corpus):
  class OtherByte(ByteTokenizer):
    pass
  cfg = DataConfig(source="arrayrecord", paths=(str(corpus["shards"]),))
  with pytest.raises(ValueError, match="prepared with another tokenizer .*rerun data.prepare"):
    build_train_and_eval(cfg, vocab_size=300, seq_len=32, batch_size=4, seed=0,
                         tokenizer=OtherByte())


def test_unfinished_prepare_is_refused(tmp_path):
  jsonl = _jsonl(tmp_path / "c.jsonl")
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "hybridmoe_jax.data.prepare", f"--input={jsonl}",
         f"--output={out}", "--docs_per_shard=6"]
  killed = subprocess.run(cmd + ["--debug_die_after_shards=3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
  assert killed.returncode == 137 and not (out / "index.json").exists()
  assert (out / "shard-00002.json").exists() and not (out / "shard-00003.json").exists()
  with pytest.raises(ValueError, match="unfinished data.prepare"):
    sources_lib.make_source("arrayrecord", [str(out)])
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert "prepare: 40/40 documents (100.0%)" in done.stderr
  whole = tmp_path / "whole"
  prepare_lib.prepare([str(jsonl)], str(whole), "byte", docs_per_shard=6, progress=None)
  names = sorted(p.name for p in whole.iterdir())
  assert names == sorted(p.name for p in out.iterdir())
  for name in names:  # resumed after the kill == never killed, byte for byte
    assert (out / name).read_bytes() == (whole / name).read_bytes(), name
  other = subprocess.run(cmd[:-1] + ["--docs_per_shard=5"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
  assert other.returncode == 1 and other.stderr.strip().splitlines()[-1] == (
      f"error: --output {out} holds a prepare with other settings (docs_per_shard); use a new "
      "--output, or the original arguments to resume it")


def test_bad_token_record_is_skipped_not_crashed(tmp_path):
  """A shard edited after indexing: a record that is not whole int32 ids is skipped."""
  src = record_sources
  with pytest.raises(ValueError, match="not 2 or more int32 ids"):
    src.decode_tokens(b"\x01\x02\x03")
  safe = sources_lib.SafeSource([np.arange(3, dtype=np.int32), "text"], "t")
  assert isinstance(safe[0], np.ndarray) and safe[1] == "text"


def test_pipeline_passes_tokens_through(corpus):
  src = sources_lib.make_source("arrayrecord", [str(corpus["shards"])])
  text = sources_lib.make_source("jsonl", [str(corpus["jsonl"])])
  a = make_pipeline(src, tokenizer=TOK, seq_len=32, batch_size=2, seed=1)
  b = make_pipeline(text, tokenizer=TOK, seq_len=32, batch_size=2, seed=1)
  assert _same([next(a) for _ in range(3)], [next(b) for _ in range(3)])


def test_prepared_shards_by_dot_slash_glob(corpus, monkeypatch):
  """A glob written "./shards/*.array_record" names its hits "./shards/x"; the index's
  directory is "shards": the shards were refused as "not listed in its index.json"."""
  monkeypatch.chdir(corpus["shards"].parent)
  src = sources_lib.make_source("arrayrecord", ["./shards/*.array_record"])
  assert len(src) == len(DOCS) and src.tokenized
  np.testing.assert_array_equal(src[5], TOK.encode(DOCS[5], bos=True, eos=True))


def test_prepare_infers_every_arrayrecord_suffix():
  """The arrayrecord source reads *.arrayrecord too; prepare asked for --kind on them."""
  assert prepare_lib.infer_kind(["a.array_record", "b-*.arrayrecord"]) == "arrayrecord"
  assert prepare_lib.infer_kind(["c.jsonl"]) == "jsonl"
  with pytest.raises(ValueError, match="--kind: cannot tell"):
    prepare_lib.infer_kind(["c.jsonl", "d.parquet"])
