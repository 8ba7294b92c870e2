"""The one run lifecycle (train/lifecycle.py) of pre-training and RL: what is set up before
the body, what `begin` adds, and that everything is closed and the lock released however the
body ends."""

import os

import pytest

from hybridmoe_jax.cli.workdir_lock import LOCK_FILE
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.train import lifecycle
from hybridmoe_jax.train.workdir_config import CONFIG_FILE
from hybridmoe_jax.train.stage_plan import build_plan
from tests.conftest import load_config


def _open(run, workdir, **kw):
  t = run.train
  return lifecycle.open_run(run, str(workdir), ByteTokenizer(),
                            schedule=build_plan(run).schedule(), batch_size=t.batch_size,
                            grad_accum=t.grad_accum, seq_len=t.seq_len, **kw)


def test_open_run_sets_up_begins_and_always_closes(tmp_path):
  run = run_config_from_dict(load_config("tiny"))
  seen = []
  with pytest.raises(RuntimeError, match="the body failed"):
    with _open(run, tmp_path / "w", prepare=lambda rt: seen.append(rt) or "inputs") as r:
      assert r.workdir == os.path.abspath(tmp_path / "w") and r.inputs == "inputs"
      assert seen == [r.rt] and r.restored is None and int(r.state.step) == 0
      assert os.path.exists(os.path.join(r.workdir, LOCK_FILE))   # held by this run
      assert r.meta is None and r.monitor is None                 # begin() not called yet
      monitor = r.begin()
      assert os.path.exists(os.path.join(r.workdir, CONFIG_FILE))
      assert set(r.meta) == {"model_config", "signature", "config"}
      raise RuntimeError("the body failed")
  assert monitor.jsonl.closed
  assert not os.path.exists(tmp_path / "w" / LOCK_FILE)   # released: the next run may start
  with _open(run, tmp_path / "w") as again:
    assert again.restored is None   # nothing was saved


def test_a_bad_workdir_stops_before_anything_is_built(tmp_path):
  run = run_config_from_dict(load_config("tiny"))
  (tmp_path / "file").write_text("x")
  built = []
  with pytest.raises(ValueError, match="is a file"):
    with _open(run, tmp_path / "file", prepare=built.append):
      pass
  assert not built
