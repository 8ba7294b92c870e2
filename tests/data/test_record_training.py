"""Acceptance: a tiny run trained from prepared ArrayRecord shards and from Parquet has the
losses of the same run from the JSONL of the same text (same seed), and a resumed shard run
continues exactly (five in-process runs of the tiny model, 2-4 steps each: ~60 s on the
2-core box, so slow; tests/data/test_record_sources.py checks the same batches fast)."""

import json

import pytest

pytest.importorskip("array_record", reason="the data extra (array-record) is not installed")
pytest.importorskip("pyarrow", reason="the data extra (pyarrow) is not installed")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from hybridmoe_jax.data import prepare as prepare_lib  # noqa: E402
from hybridmoe_jax.train.loop import train_and_evaluate  # noqa: E402
from hybridmoe_jax.config.run import run_config_from_dict  # noqa: E402
from tests.conftest import one_device  # noqa: E402
from tests._support import tiny_run_config  # noqa: E402
from tests.train.train_fakes import train_losses  # noqa: E402

DOCS = [f"doc {i}: " + "the quick brown fox " * (1 + i % 5) for i in range(30)]


def _config(source, path, **train):
  config = tiny_run_config(**{**dict(steps=4, checkpoint_every=2, eval_every=0,
                                     heatmap_every=0, async_checkpoints=False), **train})
  config.model.vocab_size = 259
  config.data.update(dict(source=source, paths=(str(path),), tokenizer="byte"))
  return config


def _run(config, workdir):
  with one_device():
    train_and_evaluate(run_config_from_dict(config), str(workdir))
  return train_losses(workdir)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("text")
  (d / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
  pq.write_table(pa.table({"text": DOCS}), str(d / "c.parquet"), row_group_size=8)
  prepare_lib.prepare([str(d / "c.jsonl")], str(d / "shards"), "byte", docs_per_shard=8,
                      progress=None)
  return d


@pytest.fixture(scope="module")
def jsonl_losses(files, tmp_path_factory):
  return _run(_config("jsonl", files / "c.jsonl"), tmp_path_factory.mktemp("jsonl"))


@pytest.mark.slow
def test_shards_and_parquet_train_like_jsonl_and_resume_exactly(files, jsonl_losses, tmp_path):
  assert len(jsonl_losses) == 4
  shards = _run(_config("arrayrecord", files / "shards"), tmp_path / "shards")
  assert shards == jsonl_losses
  parquet = _run(_config("parquet", files / "c.parquet"), tmp_path / "parquet")
  assert parquet == jsonl_losses
  # Resume: 2 steps (a checkpoint at step 2), then the same workdir to step 4.
  _run(_config("arrayrecord", files / "shards", steps=2), tmp_path / "resumed")
  assert _run(_config("arrayrecord", files / "shards"), tmp_path / "resumed") == jsonl_losses
