"""Trial 5: non-finite losses. (a) one NaN-producing batch in-process: that update is
skipped with one warning and the run finishes; (b) the issue's divergent run through
`run_train.py`: one error line, exit 1, nothing saved after the divergence (slow)."""

import json
import math
import os

import numpy as np
import pytest

from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests._support import tiny_run_config
from tests.faults import helpers
from tests.train.train_fakes import FakeIterator

NAN_AT = 3  # batch index (0-based) whose loss is NaN: the update of step 4 is skipped


class _NaNWeights(FakeIterator):
  """FakeIterator with per-token loss weights (all 1), NaN for one batch: the loss of that
  step is NaN while tokens and segment ids stay valid."""

  def __next__(self):
    index = self.index
    batch = super().__next__()
    w = np.ones(batch["tokens"].shape, np.float32)
    if index == NAN_AT:
      w[:] = np.nan
    return {**batch, "loss_weights": w}


def test_one_nan_batch_is_skipped_and_training_finishes(tmp_path):
  config = tiny_run_config(trial=True)
  t = config.train
  with helpers.LogLines() as log:
    s = train_and_evaluate(run_config_from_dict(config), str(tmp_path),
                           data=helpers.fake_data(config, _NaNWeights(t.batch_size, t.seq_len)))
  assert s["end_step"] == 8 and s["skipped_steps"] == 1 and s["stopped_by"] is None
  skipped = [l for l in log.messages() if "update skipped" in l]
  assert len(skipped) == 1 and skipped[0].startswith(f"step {NAN_AT + 1}:"), log.messages()
  losses = helpers.train_losses(tmp_path)
  assert [k for k, v in losses.items() if not math.isfinite(float(v))] == [NAN_AT + 1]
  assert math.isfinite(s["last_loss"]) and math.isfinite(s["eval"]["loss"])
  # Step 4's update was skipped, so its checkpoint is deferred to the next due one (6).
  assert helpers.committed_steps(tmp_path) == [2, 6, 8]


def _fingerprint(workdir, step):
  with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
    return json.load(f)["fingerprint"]


@pytest.mark.slow
def test_divergent_run_stops_with_one_line(tmp_path):
  # The issue's reproduction, on the fault trials' tiny model.
  r = helpers.run_train(tmp_path, "--config.train.lr=10.0", "--config.train.clip=0.0",
                        "--config.train.warmup=0", "--config.train.steps=60")
  errors = helpers.error_lines(r.stdout)
  assert r.returncode == 1, r.stdout[-3000:]
  assert len(errors) == 1 and errors[0].startswith("error: training diverged"), errors
  assert "Traceback" not in r.stdout
  records = [e for e in helpers.metrics_events(tmp_path) if e.get("split") == "train"]
  last_finite = max((e["step"] for e in records if isinstance(e["loss"], float)
                     and math.isfinite(e["loss"])), default=0)
  steps = helpers.committed_steps(tmp_path)
  # Checkpoints only up to the last good step; every one of them finite.
  assert all(s <= last_finite for s in steps), (steps, last_finite)
  for s in steps:
    assert all(math.isfinite(v) for v in _fingerprint(tmp_path, s))
  print(f"diverged: checkpoints {steps}, last finite loss at step {last_finite}")
