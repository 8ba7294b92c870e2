"""RL learns (slow, ~35 min on 2 idle cores): from the SFT warm start of configs/rl_tiny.py
(600 steps), 150 GRPO iterations raise held-out greedy success at levels 1 and 2 (two and
three calculator calls) by >= 0.2 and the curriculum promotes at least one level. The same
run as `benchmarks/rl_learning.py --seeds=2 --algos=grpo --iterations=150 --eval_every=30
--eval_episodes=96 --eval_levels=1,2,3` (BENCHMARKS.md "Agentic RL"; deterministic on CPU:
L1 0.73 -> 0.96, L2 0.65 -> 0.94, 3 promotions)."""

import argparse

import pytest

from tests._support import load_file_module
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _benchmark():
  return load_file_module("benchmarks/rl_learning.py", "rl_learning")


def test_grpo_raises_horizon_2_and_3_success_and_promotes(tmp_path):
  rl_learning = _benchmark()
  args = argparse.Namespace(out=str(tmp_path), config=str(ROOT / "configs" / "rl_tiny.py"),
                            seeds=[2], algos=["grpo"], iterations=150, eval_every=30,
                            eval_episodes=96, eval_levels="1,2,3", group_size=8, opmd_tau=1.0,
                            sft_steps=None, sft_levels="", start_level=None)
  (rec,) = rl_learning.run(args)
  assert rec["gain"]["arithmetic/L1"] >= 0.2, rec
  assert rec["gain"]["arithmetic/L2"] >= 0.2, rec
  assert rec["after"]["arithmetic/L3"] >= rec["before"]["arithmetic/L3"] - 0.05, rec
  assert rec["promotions"] >= 1, rec
