"""Quantile Balancing inside the training loop (slow: two short tiny-model runs).

benchmarks/qb_training.py prints the full curves; this checks their summary.
"""

import json

import numpy as np
import pytest

from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests.conftest import load_config


def _worst_maxvio(workdir) -> np.ndarray:
  out = {}
  for line in open(workdir / "metrics.jsonl"):
    r = json.loads(line)
    if r.get("split") == "train":
      out[r["step"]] = max(layer["max_vio"] for layer in r["moe"].values())
  return np.array([out[s] for s in sorted(out)])


def _run(balancing, workdir):
  config = load_config("tiny")
  config.model.moe.balancing = balancing
  config.train.update(dict(steps=50, seq_len=128, batch_size=8, warmup=10, log_every=1,
                           eval_every=0, eval_batches=1, checkpoint_every=0, heatmap_every=0))
  train_and_evaluate(run_config_from_dict(config), str(workdir))
  return _worst_maxvio(workdir)


@pytest.mark.slow
def test_qb_keeps_maxvio_low_and_none_does_not(tmp_path):
  qb = _run("qb", tmp_path / "qb")
  none = _run("none", tmp_path / "none")
  tail_qb, tail_none = qb[-20:].mean(), none[-20:].mean()
  assert tail_qb < 0.45, qb
  assert tail_none > 2 * tail_qb and tail_none > 0.8, none
