"""benchmarks/attnres_depth.py: the k-hop generator against its definition, the variants, the
interval arithmetic, and a smoke run."""

import json

import numpy as np
import pytest

from tests._support import load_file_module


def _load():
  return load_file_module("benchmarks/attnres_depth.py")


def test_khop_matches_definition():
  mod = _load()
  hops = np.array([1, 2, 3, 5])
  inputs, targets, k = mod.khop_batch(np.random.default_rng(3), 40, 30, 3, hops)
  assert inputs.shape == targets.shape == (40, 30) and set(k) <= set(hops)
  assert (targets[:, 0] == -1).all()
  for row in range(40):
    assert inputs[row, 0] == 3 + list(hops).index(k[row])      # the hop-count token
    x = inputs[row, 1:].tolist()
    assert targets[row, 1:].tolist() == mod.khop_reference(x, int(k[row]))


def test_khop_reference_by_hand():
  mod = _load()
  # sigma: 0 -> -, 1 -> -, 2 (a, last a at 0) -> 1, 3 (b, last b at 1) -> 2, 4 (a, at 2) -> 3
  x = [0, 1, 0, 1, 0]
  assert mod.khop_reference(x, 1) == [-1, -1, 1, 0, 1]
  assert mod.khop_reference(x, 2) == [-1, -1, -1, 1, 0]   # 3 -> 2 -> 1 (x=1); 4 -> 3 -> 2 (x=0)


def test_variants_differ_only_in_attnres():
  mod = _load()
  on = mod.variant_config(16, True, alphabet=4, num_hops=4, d_model=32, block=2)
  off = mod.variant_config(16, False, alphabet=4, num_hops=4, d_model=32, block=2)
  assert on.attnres.enabled and not off.attnres.enabled
  assert on.layer_kinds == off.layer_kinds and on.layer_kinds.count("mla") == 4
  assert not any(on.is_moe_layer(i) for i in range(16))
  assert on.vocab_size == 8


def test_intervals():
  mod = _load()
  mean, lo, hi = mod.t_interval([0.1, 0.2, 0.3])
  assert mean == pytest.approx(0.2) and hi - mean == pytest.approx(4.303 * 0.1 / np.sqrt(3))
  assert np.isnan(mod.t_interval([0.5])[1])
  rng = np.random.default_rng(0)
  scored = np.ones((50, 8), bool)
  same = rng.random((50, 8)) < 0.5
  assert mod.paired_bootstrap(same, same, scored, rng) == (0.0, 0.0)
  better = same | (rng.random((50, 8)) < 0.5)
  lo, hi = mod.paired_bootstrap(better, same, scored, rng)
  assert 0 < lo < (better.mean() - same.mean()) < hi
  assert mod.paired_bootstrap(same, same, np.zeros_like(scored), rng) is None


def test_smoke_run(tmp_path):
  mod = _load()
  out = tmp_path / "ar.jsonl"
  rows, summary = mod.main(["--layers=2", "--seeds=0", "--steps=2", "--batch=2",
                            "--seq_len=12", "--hops=1,2", "--eval_samples=8", "--d_model=16",
                            "--log_every=0", f"--out={out}"])
  assert [(r["layers"], r["attnres"]) for r in rows] == [(2, True), (2, False)]
  assert all(set(r["accuracy"]) == {"1", "2"} for r in rows)
  assert [s["k"] for s in summary] == ["1", "2", "mean"]
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert lines[:2] == rows and len(lines) == 5


def test_rejects_bad_args():
  with pytest.raises(SystemExit):
    _load().main(["--layers=0"])
  with pytest.raises(SystemExit):
    _load().main(["--alphabet=1"])
