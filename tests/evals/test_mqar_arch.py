"""Smoke test of benchmarks/mqar_arch.py: a few steps, one tiny cell, rows and JSONL out."""

import json

import pytest

from tests._support import load_file_module


def _load():
  return load_file_module("benchmarks/mqar_arch.py")


def test_arch_configs():
  mod = _load()
  hybrid = mod.arch_config("hybrid", vocab=48)
  assert hybrid.layer_kinds == ("kda", "kda", "kda", "mla")
  assert not any(hybrid.is_moe_layer(i) for i in range(hybrid.num_layers))
  unb = mod.arch_config("kda_unbounded", vocab=48)
  assert unb.layer_kinds == ("kda",) * 4 and unb.kda.gate == "unbounded"
  assert mod.arch_config("kda", vocab=48).kda.gate == "bounded"


def test_smoke_run(tmp_path):
  mod = _load()
  out = tmp_path / "m.jsonl"
  rows = mod.main(["--steps=2", "--batch=2", "--lengths=16", "--pairs=2", "--archs=mla",
                   "--vocab=48", "--eval_samples=2", "--log_every=0", f"--out={out}"])
  assert [(r["arch"], r["length"], r["pairs"]) for r in rows] == [("mla", 16, 2)]
  assert 0.0 <= rows[0]["accuracy"] <= 1.0
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert lines == rows


def test_rejects_unknown_arch():
  with pytest.raises(SystemExit):
    _load().main(["--archs=rwkv"])
