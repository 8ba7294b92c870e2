"""Curriculum data: stage pipelines, staged iterator resume, packing, mix, sources, bad files.

References are independent of the pipeline: token counts per document from the document
strings, segment layouts re-derived with numpy, mixing shares from the configured weights.
"""

import collections
import json
import logging

import numpy as np
import pytest

from hybridmoe_jax.data import long_docs, retrieval, stages
from hybridmoe_jax.data.sources import JsonlSource, TextFileSource
from hybridmoe_jax.data.tokenizers.byte import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer

TOK = ByteTokenizer()
KEYS = ("tokens", "segment_ids", "positions")


def _letter_docs(letters, seed=0, lo=5, hi=150):
  """One document per letter, made of that letter only (so tokens identify their document)."""
  rng = np.random.default_rng(seed)
  return [ch * int(rng.integers(lo, hi)) for ch in letters]


def _stage(comps, seq_len=32, batch=4, steps=5, index=0, seed=0, **kw):
  return stages.StageData(index, seq_len, batch, steps, tuple(comps), seed=seed, **kw)


def _it(stage, **kw):
  return iter(stages.make_stage_dataset(stage, tokenizer=TOK, prefetch_batches=0, **kw))


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b):
  return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)


def _rows(batches):
  return [{k: b[k][r] for k in KEYS} for b in batches for r in range(len(b["tokens"]))]


def _epoch(docs, shard_index=0, shard_count=1, **kw):
  st = _stage([stages.Component("a", docs, 1.0)], **kw)
  return _rows(list(_it(st, num_epochs=1, drop_remainder=False, shard_index=shard_index,
                        shard_count=shard_count)))


def test_same_seed_same_batches_other_seed_differs():
  docs = _letter_docs("abcdefghij")
  comps = [stages.Component("a", docs, 1.0), stages.Component("b", _letter_docs("KLMN", 1), 1.0)]
  a, b, c = (_take(_it(_stage(comps, seed=s)), 6) for s in (3, 3, 4))
  assert _same(a, b) and not _same(a, c)


def test_host_shards_are_disjoint_and_cover_the_documents():
  docs = _letter_docs("abcdefghijklmnopq")
  seen = []
  for host in range(3):
    rows = _epoch(docs, shard_index=host, shard_count=3)
    seen.append({chr(t) for r in rows for t in r["tokens"] if t < 256})
  assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
  assert set().union(*seen) == set("abcdefghijklmnopq")


def test_epoch_keeps_every_token_once_and_segments_are_well_formed():
  docs = _letter_docs("abcdefghijklmnopqrstuvwxyz", lo=1, hi=120)  # many longer than a row
  T = 32
  rows = _epoch(docs, seq_len=T, batch=3)
  counts = collections.Counter(int(t) for r in rows for t, s in zip(r["tokens"], r["segment_ids"])
                               if s > 0)
  for d in docs:
    assert counts[ord(d[0])] == len(d)        # no byte of any document lost or duplicated
  assert counts[BOS_ID] == counts[EOS_ID] == len(docs)
  for r in rows:
    tok, seg, pos = (np.asarray(r[k]) for k in KEYS)
    assert tok.shape == seg.shape == pos.shape == (T,)
    real = seg > 0
    assert np.all(tok[~real] == PAD_ID) and np.all(pos[~real] == 0)
    # Segments: contiguous runs numbered 1, 2, ... with positions 0..len-1 inside each.
    ids = seg[real]
    assert np.all(np.diff(ids) >= 0) and (ids.size == 0 or ids[0] == 1)
    assert set(ids.tolist()) == set(range(1, int(seg.max(initial=0)) + 1))
    for s in range(1, int(seg.max(initial=0)) + 1):
      where = np.flatnonzero(seg == s)
      assert np.array_equal(where, np.arange(where[0], where[0] + len(where)))
      assert np.array_equal(pos[where], np.arange(len(where)))
      body = {int(t) for t in tok[where] if t < 256}
      assert len(body) <= 1                   # one document (one letter) per segment


def test_long_document_upsampling():
  lengths = np.array([10, 50, 3, 80, 49])
  got = stages.upsampled_indices(np.array([0, 1, 3, 4]), lengths, min_bytes=50, factor=3)
  assert got.tolist() == [0, 1, 1, 1, 3, 3, 3, 4]
  docs = ["a" * 5, "b" * 60, "c" * 8, "d" * 70]
  st = _stage([stages.Component("a", docs, 1.0)], long_upsample=2, long_min_bytes=50)
  rows = _rows(list(_it(st, num_epochs=1, drop_remainder=False)))
  counts = collections.Counter(int(t) for r in rows for t in r["tokens"] if t < 256)
  assert [counts[ord(c)] for c in "abcd"] == [5, 120, 8, 140]


def test_mix_realised_within_tolerance():
  # Every document + BOS/EOS fills exactly one row, so rows count documents per source.
  a, b, c = ["a" * 30] * 7, ["b" * 30] * 5, ["c" * 30] * 11
  comps = [stages.Component("a", a, 0.5), stages.Component("b", b, 0.3),
           stages.Component("c", c, 0.2)]
  rows = _rows(_take(_it(_stage(comps, seq_len=32, batch=8)), 30))
  first = collections.Counter(chr(int(r["tokens"][1])) for r in rows)
  for name, w in zip("abc", (0.5, 0.3, 0.2)):
    assert abs(first[name] / len(rows) - w) < 0.03


def _staged(docs, steps=(3, 4, 2), lens=(16, 32, 64), tokens_per_step=128):
  comps = (stages.Component("a", docs, 1.0),
           stages.Component("r", retrieval.RetrievalSource(100, seed=1), 0.1))
  datas = [stages.StageData(k, T, tokens_per_step // T, n, comps, seed=11 * k)
           for k, (T, n) in enumerate(zip(lens, steps))]
  return stages.StagedIterator(
      datas, lambda st: stages.make_stage_dataset(st, tokenizer=TOK, prefetch_batches=0))


@pytest.mark.parametrize("stop", [2, 3, 5, 7])   # inside stages, and 3, 7 at boundaries
def test_staged_resume_is_exact_inside_and_at_stage_boundaries(stop):
  docs = _letter_docs("abcdefghijklmnopqrstuvwxyz")
  ref = _take(_staged(docs), 11)
  it = _staged(docs)
  _take(it, stop)
  state = json.loads(json.dumps(it.get_state()))
  resumed = _staged(docs)
  resumed.set_state(state)
  assert _same(_take(resumed, 11 - stop), ref[stop:])


def test_stages_switch_shapes_and_start_fresh_packing():
  docs = _letter_docs("abcdefghij")
  it = _staged(docs)
  shapes = []
  for _ in range(10):
    b = next(it)
    shapes.append((b["tokens"].shape, it.stage, it.batch_shape))
  assert [s[0] for s in shapes] == [(8, 16)] * 3 + [(4, 32)] * 4 + [(2, 64)] * 3
  assert [s[0] for s in shapes] == [s[2] for s in shapes]
  assert [s[1] for s in shapes] == [0] * 3 + [1] * 4 + [2] * 3
  assert all(b["tokens"].size == 128 for b in _take(_staged(docs), 9))   # tokens/step constant
  # Stage 1's first batch is that of a fresh stage-1 pipeline (no carry-over of open rows).
  it = _staged(docs)
  _take(it, 3)
  fresh = next(iter(stages.make_stage_dataset(it.stages[1], tokenizer=TOK, prefetch_batches=0)))
  assert _same([next(it)], [fresh])
  assert it.get_state()["stage"] == 1


def test_bad_state_is_refused():
  it = _staged(_letter_docs("abc"))
  with pytest.raises(ValueError, match="stage 5"):
    it.set_state({"stage": 5, "step_in_stage": 0, "iterator": None})


def test_stdlib_long_documents(tmp_path):
  (tmp_path / "pkg" / "sub").mkdir(parents=True)
  (tmp_path / "pkg" / "tests").mkdir()
  (tmp_path / "pkg" / "b.py").write_text("B = 1\n")
  (tmp_path / "pkg" / "a.py").write_text("A = 1\n")
  (tmp_path / "pkg" / "sub" / "c.py").write_text("C = 1\n")
  (tmp_path / "pkg" / "tests" / "t.py").write_text("T = 1\n")
  (tmp_path / "mod.py").write_text("M = 1\n")
  (tmp_path / "site-packages" / "x").mkdir(parents=True)
  (tmp_path / "site-packages" / "x" / "y.py").write_text("Y = 1\n")
  src = long_docs.StdlibLongDocSource(tmp_path)
  assert src.names == ("mod", "pkg")
  assert src[1] == ("# file: pkg/a.py\nA = 1\n\n# file: pkg/b.py\nB = 1\n\n"
                    "# file: pkg/sub/c.py\nC = 1\n")
  assert list(src.lengths) == [len(src[0]), len(src[1]) - 2]   # sizes + headers, no joins
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="no Python files"):
    long_docs.StdlibLongDocSource(tmp_path / "empty")
  with pytest.raises(ValueError, match="not a directory"):
    long_docs.StdlibLongDocSource(tmp_path / "missing")
  real = long_docs.StdlibLongDocSource()
  assert len(real) > 100 and real.lengths.sum() > 2_000_000 and "asyncio" in real.names
  assert real[real.names.index("asyncio")].count("# file: asyncio/") > 10


def test_files_failing_mid_run_are_skipped_and_counted(tmp_path, caplog):
  for i in range(4):
    (tmp_path / f"{i}.txt").write_text(chr(ord("a") + i) * 20)
  text = TextFileSource(tmp_path)
  jl = tmp_path / "x.jsonl"
  jl.write_text("".join(json.dumps({"text": c * 20}) + "\n" for c in "wxyz"))
  jsonl = JsonlSource(jl)
  # After indexing: one file turns into bad UTF-8, one vanishes, one JSON line breaks.
  (tmp_path / "1.txt").write_bytes(b"\xff\xfe" * 10)
  (tmp_path / "2.txt").unlink()
  raw = jl.read_bytes()
  jl.write_bytes(raw.replace(b'{"text": "xx', b'{"text"; "xx', 1))  # same length
  comps = [stages.Component("text", text, 1.0), stages.Component("jsonl", jsonl, 1.0)]
  with caplog.at_level(logging.WARNING):
    it = _it(_stage([stages.Component("text", text, 1.0)]), num_epochs=1,
             drop_remainder=False)
    rows = _rows(list(it))
    jrows = _rows(list(_it(_stage([stages.Component("jsonl", jsonl, 1.0)]), num_epochs=1,
                           drop_remainder=False)))
    mixed = _take(_it(_stage(comps)), 5)       # a mixture keeps going past the bad files
  got = {chr(int(t)) for r in rows + jrows for t in r["tokens"] if t < 256}
  assert got == set("adwyz")
  assert "skipped document" in caplog.text and "so far" in caplog.text
  assert len(mixed) == 5


@pytest.mark.slow
def test_worker_processes_resume_exactly():
  """mp_prefetch with 2 workers: deterministic and resumable (same worker count)."""
  docs = _letter_docs("abcdefghijklmnopqrstuvwxyz")
  st = _stage([stages.Component("a", docs, 1.0),
               stages.Component("r", retrieval.RetrievalSource(100, seed=1), 0.2)])
  it = _it(st, num_workers=2)
  ref = _take(it, 8)
  it.close()
  it = _it(st, num_workers=2)
  _take(it, 3)
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  resumed = _it(st, num_workers=2)
  resumed.set_state(state)
  assert _same(_take(resumed, 5), ref[3:])
  resumed.close()
