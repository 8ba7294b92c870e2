"""Sources, splits, config and the grain pipeline: determinism, resume, bad input."""

import json
import logging
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hybridmoe_jax.config import ConfigError, from_dict
from hybridmoe_jax.data import (BundledTextSource, JsonlSource, TextFileSource,
                                build_train_and_eval, eval_batches, make_pipeline, make_source,
                                split_source, unpack_row)
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.config.run import DataConfig

TOK = ByteTokenizer()
KEYS = ("tokens", "segment_ids", "positions")


@pytest.fixture(scope="module")
def bundled():
  return BundledTextSource()


def _pipe(source, seed=0, **kw):
  kw = {"seq_len": 64, "batch_size": 4, **kw}
  return make_pipeline(source, tokenizer=TOK, seed=seed, **kw)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b):
  return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)


def _small_docs(n=12):
  rng = np.random.default_rng(0)
  return [f"doc{i}:" + "xyz" * int(rng.integers(1, 60)) for i in range(n)]


def test_bundled_corpus_batches(bundled):
  assert len(bundled) >= 50 and bundled.num_bytes > 100_000
  batch = next(_pipe(bundled, seq_len=128, batch_size=8))
  for k in KEYS:
    assert batch[k].shape == (8, 128) and batch[k].dtype == np.int32
  assert batch["tokens"].max() < TOK.vocab_size and batch["tokens"].min() >= 0


def test_same_seed_same_batches_other_seed_differs(bundled):
  a, b, c = (_take(_pipe(bundled, seed=s), 6) for s in (1, 1, 2))
  assert _same(a, b) and not _same(a, c)


@pytest.mark.parametrize("seed, prefetch", [(0, 0), (1, 0), (2, 3)])
def test_resume_from_saved_state_gives_identical_batches(seed, prefetch):
  docs = _small_docs()  # ~1 epoch per 2 batches: the resume points cross epoch boundaries
  it = _pipe(docs, seed=seed, prefetch_batches=prefetch)
  _take(it, int(np.random.default_rng(seed).integers(0, 12)))
  state = json.loads(json.dumps(it.get_state()))
  want = _take(it, 8)
  resumed = _pipe(docs, seed=seed, prefetch_batches=prefetch)
  resumed.set_state(state)
  assert _same(_take(resumed, 8), want)


def test_one_epoch_keeps_every_document_byte():
  docs = _small_docs()
  rows = [{k: b[k][r] for k in KEYS}
          for b in _pipe(docs, num_epochs=1, drop_remainder=False) for r in range(len(b["tokens"]))]
  # Each document starts with BOS in its first piece; the text bytes of all pieces add up.
  text = "".join(TOK.decode(p) for r in rows for p in unpack_row(r))
  assert sorted(text) == sorted("".join(docs))
  n_tokens = sum(int((r["segment_ids"] > 0).sum()) for r in rows)
  assert n_tokens == sum(len(d) + 2 for d in docs)  # + BOS + EOS per document


def test_shards_partition_the_documents():
  docs = _small_docs(10)
  counts = [sum(int((b["segment_ids"] > 0).sum()) for b in
                _pipe(docs, num_epochs=1, drop_remainder=False, shard_index=i, shard_count=3))
            for i in range(3)]
  assert sum(counts) == sum(len(d) + 2 for d in docs) and min(counts) > 0


def test_weighted_mixture_proportions():
  a, b = ["a" * 62] * 5, ["b" * 62] * 7  # + BOS/EOS = one full row per document
  it = _pipe([a, b], weights=[3, 1])
  firsts = np.concatenate([x["tokens"][:, 1] for x in _take(it, 50)])
  assert np.mean(firsts == ord("a")) == pytest.approx(0.75, abs=0.05)
  with pytest.raises(ValueError, match="weight"):
    _pipe([a, b], weights=[1.0])


def test_heldout_split_is_disjoint_and_deterministic(bundled):
  train, held = split_source(bundled, 0.05, seed=0)
  assert len(held) == round(0.05 * len(bundled)) and len(train) + len(held) == len(bundled)
  assert not set(train.indices) & set(held.indices)
  assert not {train[i] for i in range(len(train))} & {held[i] for i in range(len(held))}
  assert np.array_equal(split_source(bundled, 0.05, seed=0)[1].indices, held.indices)
  assert not np.array_equal(split_source(bundled, 0.05, seed=1)[1].indices, held.indices)
  assert len(split_source(["a", "b"], 0.01, seed=0)[1]) == 1  # at least one held out
  with pytest.raises(ValueError, match="at least 2 documents"):
    split_source(["a"], 0.5, seed=0)


def test_eval_batches_are_fixed_and_padded():
  docs = _small_docs(5)
  a = eval_batches(docs, TOK, 64, 4, max_batches=100)
  assert _same(a, eval_batches(docs, TOK, 64, 4, max_batches=100))
  assert all(b[k].shape == (4, 64) for b in a for k in KEYS)
  assert sum(int((b["segment_ids"] > 0).sum()) for b in a) == sum(len(d) + 2 for d in docs)
  assert len(eval_batches(docs, TOK, 64, 4, max_batches=1)) == 1


def test_text_files_and_directories(tmp_path, caplog):
  (tmp_path / "sub").mkdir()
  (tmp_path / "a.txt").write_text("alpha")
  (tmp_path / "sub" / "b.md").write_text("beta ✓")
  (tmp_path / "sub" / "c.json").write_text("not taken: wrong suffix")
  (tmp_path / ".hidden.txt").write_text("not taken: hidden")
  (tmp_path / "empty.txt").write_text("  \n")
  (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
  with caplog.at_level(logging.WARNING):
    src = TextFileSource(tmp_path)
  assert [src[i] for i in range(len(src))] == ["alpha", "beta ✓"]
  assert src.skipped == {"empty text": 1, "not valid UTF-8": 1}
  assert "skipped 2 of 4" in caplog.text
  assert len(TextFileSource([tmp_path / "sub" / "c.json"])) == 1  # a named file is always taken


def test_directory_listing_order_and_hidden_entries(tmp_path, monkeypatch):
  """One directory walk (storage.walk) for both listers: hidden parts skipped below the
  root, also when the root is "." (it once dropped "z.txt" and took ".hidden/x.txt");
  sources sorts as paths ("a/b" before "a-c"), storage.list_files as strings."""
  from hybridmoe_jax.data import sources, storage
  for name in ("a/b.txt", "a-c.txt", ".hidden/x.txt", ".y.txt", "z.txt", "n/m/.g/k.txt"):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("x")
  monkeypatch.chdir(tmp_path)
  assert storage.list_files(".", (".txt",)) == ["a-c.txt", "a/b.txt", "z.txt"]
  paths = sources._list_files([pathlib.Path(".")], (".txt",))  # pylint: disable=protected-access
  assert paths == [pathlib.Path(p) for p in ("a/b.txt", "a-c.txt", "z.txt")]


def test_missing_and_empty_inputs_fail_clearly(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope"):
    TextFileSource([tmp_path / "nope"])
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    JsonlSource(tmp_path / "nope.jsonl")
  (tmp_path / "empty.txt").write_text("")
  with pytest.raises(ValueError, match="no usable text"):
    TextFileSource(tmp_path / "empty.txt")
  (tmp_path / "d").mkdir()
  with pytest.raises(ValueError, match="contains no"):
    TextFileSource(tmp_path / "d")


def test_jsonl_skips_and_counts_bad_lines(tmp_path, caplog):
  path = tmp_path / "x.jsonl"
  good = [json.dumps({"text": "first ✓"}), json.dumps({"text": "second", "id": 2})]
  bad = ["{not json", '["a list"]', json.dumps({"body": "no text"}), json.dumps({"text": 5}),
         json.dumps({"text": "   "})]
  lines = [good[0].encode(), b"", *(s.encode() for s in bad), b'{"text": "caf\xe9"}',
           good[1].encode()]
  path.write_bytes(b"\n".join(lines) + b"\n")
  with caplog.at_level(logging.WARNING):
    src = JsonlSource(path)
  assert [src[i] for i in range(len(src))] == ["first ✓", "second"]
  assert src.skipped == {"malformed JSON": 1, "not valid UTF-8": 1, "not a JSON object": 1,
                         "no 'text' field": 1, "'text' not a string": 1, "empty text": 1}
  assert "skipped 6 of 8" in caplog.text
  (tmp_path / "bad.jsonl").write_text("{oops\n[1]\n")
  with pytest.raises(ValueError, match="no usable JSONL"):
    JsonlSource(tmp_path / "bad.jsonl")


def test_config_validation_names_the_field():
  assert from_dict(DataConfig, {}, "data") == DataConfig()
  for field, value, match in [("source", "web", "data.source"), ("source", "text", "data.paths"),
                              ("heldout_fraction", 0.0, "data.heldout_fraction"),
                              ("heldout_fraction", 0.6, "data.heldout_fraction"),
                              ("jsonl_field", "", "data.jsonl_field"),
                              ("heldout_seed", -1, "data.heldout_seed"),
                              ("paths", "a.txt", "data.paths"),
                              ("colour", "red", "data.colour")]:
    with pytest.raises(ConfigError, match=match):
      from_dict(DataConfig, {field: value}, "data")


def test_one_source_factory(tmp_path):
  (tmp_path / "a.txt").write_text("document a")
  assert isinstance(make_source("bundled"), BundledTextSource)
  assert len(make_source("text", (str(tmp_path),))) == 1
  (tmp_path / "b.jsonl").write_text(json.dumps({"body": "document b"}) + "\n")
  assert make_source("jsonl", (str(tmp_path / "b.jsonl"),), field="body")[0] == "document b"
  with pytest.raises(ValueError, match="unknown document source kind 'web'"):
    make_source("web")


def test_build_train_and_eval(tmp_path):
  cfg = DataConfig()
  data = build_train_and_eval(cfg, vocab_size=259, seq_len=64, batch_size=2, seed=0,
                              max_eval_batches=3)
  assert next(data.train)["tokens"].shape == (2, 64) and len(data.eval_batches) == 3
  with pytest.raises(ValueError, match="model vocab_size 200"):
    build_train_and_eval(cfg, vocab_size=200, seq_len=64, batch_size=2, seed=0)
  cfg = DataConfig(source="jsonl", paths=(str(tmp_path / "missing"),))
  with pytest.raises(FileNotFoundError, match="missing"):
    build_train_and_eval(cfg, vocab_size=259, seq_len=64, batch_size=2, seed=0)
  for i in range(4):
    (tmp_path / f"{i}.txt").write_text(f"document {i} " * 20)
  cfg = DataConfig(source="text", paths=(str(tmp_path),), heldout_fraction=0.25)
  data = build_train_and_eval(cfg, vocab_size=259, seq_len=32, batch_size=2, seed=0)
  assert len(data.heldout_source) == 1 and len(data.train_source) == 3


def test_package_import_is_lazy():
  """`import hybridmoe_jax.data` loads no submodule (nor grain); names resolve on use."""
  code = ("import sys, hybridmoe_jax.data as d; "
          "before = sorted(m for m in sys.modules if m.startswith('hybridmoe_jax.data.')); "
          "print(before, 'grain' in sys.modules); d.pack_documents; print(d.make_pipeline.__module__)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True).stdout.split("\n")
  assert out[0] == "[] False" and out[1] == "hybridmoe_jax.data.pipeline"
