"""One bad record never stops a run: `data.bad_records` = "skip" (count, warn, go on) or
"error" (one line naming file and line, before any batch), for every kind of bad record.

Self-contained: builds its own files under tmp_path; the two run_train.py subprocesses are the
only slow part (~5 s for "error", which stops before compiling; a 3-step "skip" run of a
one-layer tiny model, ~20 s on 2 idle cores, more under load).
"""

import json
import logging
import subprocess
import sys

import numpy as np
import pytest

from hybridmoe_jax.config import ConfigError, from_dict
from hybridmoe_jax.data import pipeline as pipeline_lib
from hybridmoe_jax.data import sources as sources_lib
from hybridmoe_jax.data.sources import make_source
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.config.run import DataConfig
from tests.conftest import ROOT

HINT = "; set data.bad_records=skip to skip bad records"
GOOD = [f"good document {i} " * 4 for i in range(4)]
TOK = ByteTokenizer()


def _line(text) -> bytes:
  return json.dumps({"text": text}).encode()


# kind -> (the bad line, the detail the error names); the bad line is line 3 of the file.
JSONL_BAD = {
    "lone_surrogate": (b'{"text": "lone \\ud800 x"}',
                       "text holds a lone surrogate U+D800 at character 5 (not encodable as "
                       "UTF-8)"),
    "lone_low_surrogate": (b'{"text": "x \\udc00"}',
                           "text holds a lone surrogate U+DC00 at character 2 (not encodable "
                           "as UTF-8)"),
    "invalid_utf8": (b'{"text": "caf\xe9"}', "not valid UTF-8 (byte 0xe9 at byte 13)"),
    "malformed_json": (b'{"text": oops}', "malformed JSON (Expecting value, column 10)"),
    "not_an_object": (b'["a", "list"]', "the line holds a list, not a JSON object"),
    "json_string": (b'"just a string"', "the line holds a string, not a JSON object"),
    "missing_field": (b'{"body": "no text key"}', "the object has no 'text' field"),
    "number_text": (b'{"text": 5}', "'text' is a number, not a string"),
    "list_text": (b'{"text": ["a", "b"]}', "'text' is a list, not a string"),
    "null_text": (b'{"text": null}', "'text' is null, not a string"),
    "empty_text": (b'{"text": ""}', "text is empty or whitespace only"),
    "whitespace_text": (b'{"text": " \\n\\t "}', "text is empty or whitespace only"),
    "nested_too_deep": (b"[" * 100_000 + b"]" * 100_000,
                        "malformed JSON (nested too deeply to parse)"),
}


def _jsonl(tmp_path, bad: bytes, *, last: bool = False):
  """GOOD as JSONL with `bad` as line 3 (or, `last`, as the final line without a newline)."""
  lines = [_line(t) for t in GOOD]
  if last:
    data, n = b"\n".join(lines) + b"\n" + bad, len(lines) + 1
  else:
    data, n = b"\n".join(lines[:2] + [bad] + lines[2:]) + b"\n", 3
  path = tmp_path / "d.jsonl"
  path.write_bytes(data)
  return path, n


def _cases():
  for kind in JSONL_BAD:
    yield kind
  yield "truncated_last_line"
  yield from ("txt_invalid_utf8", "txt_binary", "txt_empty", "txt_whitespace")


def _make(kind, tmp_path):
  """-> (source kind, path given, where the error points, its detail)."""
  if kind == "truncated_last_line":
    path, n = _jsonl(tmp_path, b'{"text": "cut mid-rec', last=True)
    return "jsonl", path, f"{path} line {n}", (
        "malformed JSON (Unterminated string starting at, column 10); the file's last line "
        "has no newline: truncated?")
  if kind in JSONL_BAD:
    bad, detail = JSONL_BAD[kind]
    path, n = _jsonl(tmp_path, bad)
    return "jsonl", path, f"{path} line {n}", detail
  d = tmp_path / "texts"
  d.mkdir()
  for i, t in enumerate(GOOD):
    (d / f"{i}.txt").write_text(t)
  content, detail = {
      "txt_invalid_utf8": (b"caf\xe9 au lait", "not valid UTF-8 (byte 0xe9 at byte 3)"),
      "txt_binary": (b"\x89PNG\r\n\x1a\n" + bytes(range(256)),
                     "not valid UTF-8 (byte 0x89 at byte 0)"),
      "txt_empty": (b"", "text is empty or whitespace only"),
      "txt_whitespace": (b" \n\t\r\n ", "text is empty or whitespace only"),
  }[kind]
  bad = d / "2b.txt"  # sorts between 2.txt and 3.txt
  bad.write_bytes(content)
  return "text", d, str(bad), detail


def _docs(src):
  return [src[i] for i in range(len(src))]


@pytest.mark.parametrize("kind", list(_cases()))
def test_skip_counts_and_keeps_every_good_record(tmp_path, caplog, kind):
  source, path, where, detail = _make(kind, tmp_path)
  with caplog.at_level(logging.WARNING):
    src = make_source(source, (str(path),), bad_records="skip")
  assert _docs(src) == GOOD
  assert sum(src.skipped.values()) == 1
  warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
  assert len(warnings) == 1 and "\n" not in warnings[0], warnings
  assert "skipped 1 of 5" in warnings[0] and f"{where} ({detail})" in warnings[0], warnings


@pytest.mark.parametrize("kind", list(_cases()))
def test_error_names_file_and_line_in_one_line(tmp_path, kind):
  source, path, where, detail = _make(kind, tmp_path)
  with pytest.raises(sources_lib.BadRecordError) as e:
    make_source(source, (str(path),), bad_records="error")
  assert str(e.value) == f"{where}: {detail}{HINT}"
  # The same through the data section: raised while indexing, before any batch exists.
  cfg = DataConfig(source=source, paths=(str(path),), bad_records="error")
  with pytest.raises(sources_lib.BadRecordError, match="line 3|2b.txt|truncated"):
    pipeline_lib.build_train_and_eval(cfg, vocab_size=259, seq_len=32, batch_size=2, seed=0)


def test_legal_oddities_are_kept(tmp_path, caplog):
  """NUL and other control characters (escaped or raw inside a JSON string), surrogate pairs,
  a BOM, CRLF line ends, blank lines and a 2 MB line are documents, not bad records."""
  texts = ["nul \x00 inside", "bell \x07 and del \x7f", "emoji \U0001F600 pair", "x" * 2_000_000]
  lines = [b"\xef\xbb\xbf" + _line(texts[0]), _line(texts[1]) + b"\r", b"",
           b'{"text": "emoji \\ud83d\\ude00 pair"}', b"   ", _line(texts[3]),
           b'{"text": "raw\ttab \x01 ctrl"}']
  path = tmp_path / "ok.jsonl"
  path.write_bytes(b"\n".join(lines))  # the last line ends without a newline, yet is whole
  (tmp_path / "t").mkdir()
  (tmp_path / "t" / "nul.txt").write_bytes(b"a\x00b\x01c")
  with caplog.at_level(logging.WARNING):
    jsonl = sources_lib.JsonlSource(path, bad_records="error")
    text = sources_lib.TextFileSource(tmp_path / "t", bad_records="error")
  assert _docs(jsonl) == texts + ["raw\ttab \x01 ctrl"] and jsonl.skipped == {}
  assert _docs(text) == ["a\x00b\x01c"]
  assert "skipped" not in caplog.text
  assert list(TOK.encode(text[0])) == [97, 0, 98, 1, 99]


@pytest.mark.parametrize("mode", ["skip", "error"])
def test_unreadable_file_is_one_line_error_in_both_modes(tmp_path, monkeypatch, mode):
  path, _ = _jsonl(tmp_path, _line("fine"))
  (tmp_path / "t").mkdir()
  (tmp_path / "t" / "a.txt").write_text("fine")
  real_open = open

  def deny(p, *args, **kw):  # root ignores chmod 000, so deny the read here
    if str(p) in (str(path), str(tmp_path / "t" / "a.txt")):
      raise PermissionError(13, "Permission denied", str(p))
    return real_open(p, *args, **kw)

  monkeypatch.setattr(sources_lib, "open", deny, raising=False)
  for source, p, name in [("jsonl", path, path), ("text", tmp_path / "t", tmp_path / "t/a.txt")]:
    with pytest.raises(ValueError) as e:
      make_source(source, (str(p),), bad_records=mode)
    assert str(e.value) == (f"{name}: cannot read the file (Permission denied); fix its "
                            "permissions or leave it out of data.paths")


def test_config_field_is_checked():
  assert DataConfig().bad_records == "skip"
  assert from_dict(DataConfig, {"bad_records": "error"}, "data").bad_records == "error"
  with pytest.raises(ConfigError, match=r"`data.bad_records` = 'drop' .*\('skip', 'error'\)"):
    from_dict(DataConfig, {"bad_records": "drop"}, "data")


def _batches(it, n):
  return [{k: np.array(v) for k, v in next(it).items()} for _ in range(n)]


def _same(a, b) -> bool:
  return len(a) == len(b) and all(
      x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_resume_replays_the_uninterrupted_batches(tmp_path):
  """Bad records skipped at indexing shift nothing: the batches equal those of the file
  without them, and get_state / set_state at step k resumes on exactly the same batches."""
  texts = [f"document {i}: " + "abcdefgh"[i % 8] * (5 + 7 * i) for i in range(40)]
  bad = [v[0] for v in JSONL_BAD.values()]
  lines, clean = [], []
  for i, t in enumerate(texts):
    lines.append(_line(t))
    clean.append(_line(t))
    if i % 4 == 1:
      lines.append(bad[i // 4 % len(bad)])
  (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
  (tmp_path / "clean.jsonl").write_bytes(b"\n".join(clean) + b"\n")

  def build(name):
    cfg = DataConfig(source="jsonl", paths=(str(tmp_path / name),), heldout_fraction=0.1)
    return pipeline_lib.build_train_and_eval(cfg, vocab_size=259, seq_len=32, batch_size=2,
                                             seed=3, max_eval_batches=2)

  k, n = 3, 6
  whole = build("bad.jsonl")
  assert whole.train_source.parent.skipped and len(whole.train_source.parent) == 40
  before = _batches(whole.train, k)
  state = whole.train.get_state()
  after = _batches(whole.train, n)
  resumed = build("bad.jsonl")
  resumed.train.set_state(json.loads(json.dumps(state)))  # as a checkpoint stores it
  assert _same(_batches(resumed.train, n), after)
  clean_data = build("clean.jsonl")
  assert _same(_batches(clean_data.train, k + n), before + after)
  assert _same(clean_data.eval_batches, whole.eval_batches)


def test_worker_skips_a_document_that_fails_to_load_and_resumes_identically(tmp_path, caplog):
  """Text that turns bad after indexing (an edited file) or that no tokenizer can take (a
  Python source with a lone surrogate) is skipped inside the pipeline, never a crash, and
  deterministically: a resumed iterator sees what the uninterrupted one saw."""
  path = tmp_path / "d.jsonl"
  path.write_bytes(b"\n".join(_line(t) for t in GOOD) + b"\n")
  src = sources_lib.JsonlSource(path)
  line = _line(GOOD[1])
  path.write_bytes(path.read_bytes().replace(line, line[:-2] + b"  "))  # same length, cut
  docs = ["lone \ud800 surrogate", "fine one", "fine two " * 9]

  def run(source, state=None, n=None):
    it = pipeline_lib.make_pipeline(source, tokenizer=TOK, seq_len=16, batch_size=1, seed=0,
                                    shuffle=False, num_epochs=1, drop_remainder=False)
    if state is not None:
      it.set_state(state)
    return list(it) if n is None else [next(it) for _ in range(n)], it

  def n_tokens(rows):
    return sum(int((r["segment_ids"] > 0).sum()) for r in rows)

  with caplog.at_level(logging.WARNING):
    rows, _ = run(src)
  assert n_tokens(rows) == sum(len(GOOD[i]) + 2 for i in (0, 2, 3))  # + BOS and EOS each
  assert f"{path} line 2: malformed JSON" in caplog.text
  assert "the file changed after it was indexed" in caplog.text
  whole, _ = run(docs)
  assert "lone surrogate U+D800" in caplog.text
  assert n_tokens(whole) == sum(len(d) + 2 for d in docs[1:])
  first, it = run(docs, n=2)
  resumed, _ = run(docs, state=it.get_state())
  assert _same([{k: np.array(v) for k, v in b.items()} for b in first + resumed],
               [{k: np.array(v) for k, v in b.items()} for b in whole])


# ----------------------------------------------------------------------- run_train.py
_TINY = ["--config=configs/tiny.py", "--config.train.steps=3", "--config.train.seq_len=64",
         "--config.train.batch_size=2", "--config.train.eval_batches=1",
         "--config.train.heatmap_every=0", "--config.model.num_layers=1",
         "--config.model.moe.first_dense_layers=0", "--config.data.source=jsonl"]


def _run_train(path, workdir, *flags):
  # One CPU device (conftest's autouse fixture restores the user's XLA_FLAGS, xdist or not).
  return subprocess.run(
      [sys.executable, str(ROOT / "run_train.py"), *_TINY, f"--config.data.paths=('{path}',)",
       f"--workdir={workdir}", *flags], capture_output=True, text=True, timeout=180, cwd=ROOT)


def test_run_train_error_stops_before_training_with_one_line(tmp_path):
  path, n = _jsonl(tmp_path, JSONL_BAD["lone_surrogate"][0])
  p = _run_train(path, tmp_path / "w_error", "--config.data.bad_records=error")
  assert p.returncode == 1, p.stderr
  assert "Traceback" not in p.stderr, p.stderr
  last = p.stderr.strip().splitlines()[-1]
  assert last == (f"error: data: {path} line {n}: {JSONL_BAD['lone_surrogate'][1]}{HINT}"), last
  assert not (tmp_path / "w_error" / "checkpoints").exists()


@pytest.mark.slow  # fast: the in-process skip cases above and the error-mode run_train test
def test_run_train_skip_trains_past_the_bad_record(tmp_path):
  """The reported failure: this crashed in a grain worker at the step reaching line 3."""
  path, n = _jsonl(tmp_path, JSONL_BAD["lone_surrogate"][0])
  p = _run_train(path, tmp_path / "w_skip")
  assert p.returncode == 0, p.stderr[-3000:]
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  assert f"skipped 1 of 5 lines in {path} (1 lone surrogate); first: {path} line {n}" in p.stderr
  assert "step 3/3" in p.stderr
