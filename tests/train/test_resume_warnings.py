"""A resume with other data settings says which, in one warning (no training needed)."""

import dataclasses
import json

from absl import logging as absl_logging

from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.train import run_inputs
from hybridmoe_jax.config.run import default_config


def _saved(run):
  return json.dumps(dataclasses.asdict(run), default=list)


def test_changed_batch_and_seq_len_are_listed(monkeypatch):
  before = run_config_from_dict(default_config())
  config = default_config()
  config.train.update(batch_size=4, seq_len=128, lr=1e-3)  # lr is not a data setting
  now = run_config_from_dict(config)
  seen = []
  monkeypatch.setattr(absl_logging, "warning", lambda msg, *a: seen.append(msg % a))
  run_inputs.warn_changed_settings(_saved(before), now, 30)
  assert len(seen) == 1
  assert "train.batch_size: 8 before vs 4 now" in seen[0]
  assert "train.seq_len: 256 before vs 128 now" in seen[0] and "lr" not in seen[0]
  seen.clear()
  run_inputs.warn_changed_settings(_saved(now), now, 30)   # same settings: silent
  assert not seen


def test_data_fingerprint_sees_the_files_of_a_glob(tmp_path):
  """data.paths may hold globs (storage.list_files expands them): an edit of a file a glob
  names changes the fingerprint (was: a glob named no file here, so edits went unnoticed)."""
  (tmp_path / "a.txt").write_text("first corpus file\n")
  (tmp_path / "b.txt").write_text("second corpus file\n")
  config = default_config()
  config.data.update(source="text", paths=(str(tmp_path / "*.txt"),))
  run = run_config_from_dict(config)
  before = run_inputs.data_fingerprint(run)
  assert before["files"] == 2 and before["bytes"] == 37
  (tmp_path / "b.txt").write_text("second corpus file, edited\n")
  assert run_inputs.data_fingerprint(run)["digest"] != before["digest"]
