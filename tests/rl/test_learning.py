"""RL learns (slow, ~20 min on 2 cores): from the SFT warm start of configs/rl_tiny.py, 60
GRPO iterations raise held-out greedy success at level 1 (two calculator calls) by >= 0.2
and the curriculum promotes at least one level. The same runs as benchmarks/rl_learning.py
--seeds=0 --algos=grpo (BENCHMARKS.md "Agentic RL"; deterministic on CPU)."""

import argparse
import importlib.util

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _benchmark():
  spec = importlib.util.spec_from_file_location("rl_learning",
                                                ROOT / "benchmarks" / "rl_learning.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_grpo_raises_level_1_success_and_promotes(tmp_path):
  rl_learning = _benchmark()
  args = argparse.Namespace(out=str(tmp_path), config=str(ROOT / "configs" / "rl_tiny.py"),
                            seeds=[0], algos=["grpo"], iterations=60, eval_every=60,
                            eval_episodes=96, eval_levels="0,1,2", group_size=8, opmd_tau=1.0,
                            sft_steps=None)
  (rec,) = rl_learning.run(args)
  assert rec["gain"]["arithmetic/L1"] >= 0.2, rec
  assert rec["after"]["arithmetic/L0"] >= rec["before"]["arithmetic/L0"] - 0.05, rec
  assert rec["promotions"] >= 1, rec
