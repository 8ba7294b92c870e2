"""A passkey NIAH grid after every curriculum stage: does effective context grow per stage?

`train.loop.train_and_evaluate(..., on_stage_end=StageNiah.from_run(run, workdir))` (what
`run_train.py` passes when `curriculum.niah_lengths` is set) runs `niah.evaluate_niah` on the
model as each stage ends: the same prompts every time (fixed seed), greedy, on the model's own
cache (`infer.Engine`). Each grid goes to workdir/eval/niah_stage<k>.json and
niah_stage<k>.png, and a summary line to metrics.jsonl.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax

from hybridmoe_jax import plots
from hybridmoe_jax.config import require
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.evals import niah
from hybridmoe_jax.evals.runner import write_result
from hybridmoe_jax.infer import Engine
from hybridmoe_jax.config.run import RunConfig
from hybridmoe_jax.train.run_inputs import run_tokenizer


class StageNiah:
  """Callable (step, stage, model) -> dict for `train_and_evaluate(on_stage_end=...)`."""

  def __init__(self, out_dir: str, lengths: Sequence[int], depths: Sequence[float], *,
               samples: int, tokenizer: Tokenizer, num_digits: int = 5,
               prefill_chunk: int = 1024, kv_block: int = 1024, seed: int = 0,
               max_factor: float = 0.0):
    """lengths: prompt lengths in tokens; depths: needle depths in [0, 1]; samples:
    prompts per cell; prefill_chunk / kv_block: the engine's (memory O(chunk x block));
    max_factor > 0: after a stage of seq_len T only the lengths <= max_factor * T (at least
    the shortest), so early stages skip the long prompts (0: every length every time).

    Raises:
      ConfigError: a length too short for the needle and the question in this tokenizer
        (checked here, before any training).
    """
    shortest = niah.min_length(num_digits, tokenizer)
    require(bool(lengths) and min(lengths) >= shortest, "curriculum.niah_lengths",
            tuple(lengths), f"lengths >= {shortest} tokens (the needle and the question in "
            "this tokenizer)")
    self.out_dir, self.lengths, self.depths = out_dir, tuple(lengths), tuple(depths)
    self.samples, self.tokenizer, self.num_digits = samples, tokenizer, num_digits
    self.prefill_chunk, self.kv_block, self.seed = prefill_chunk, kv_block, seed
    self.max_factor = max_factor

  def lengths_after(self, seq_len: int) -> tuple[int, ...]:
    """The lengths evaluated after a stage of `seq_len` tokens."""
    if not self.max_factor:
      return self.lengths
    keep = tuple(n for n in self.lengths if n <= self.max_factor * seq_len)
    return keep or (min(self.lengths),)

  @classmethod
  def from_run(cls, run: RunConfig, workdir: str) -> "StageNiah":
    """The grid `run.curriculum` asks for, with the run's tokenizer."""
    c = run.curriculum
    return cls(os.path.join(workdir, "eval"), c.niah_lengths, c.niah_depths,
               samples=c.niah_samples, tokenizer=run_tokenizer(run),
               max_factor=c.niah_max_factor)

  def __call__(self, step: int, stage, model) -> dict[str, Any]:
    """stage: the `train.stage_plan.StagePlan` that just ended; model: a `HybridLM`."""
    lengths = self.lengths_after(stage.seq_len)
    engine = Engine(model, max_len=max(lengths) + self.num_digits,
                    prefill_chunk=self.prefill_chunk, kv_block=self.kv_block)
    result = niah.evaluate_niah(engine, lengths, self.depths, samples=self.samples,
                                num_digits=self.num_digits, seed=self.seed,
                                tokenizer=self.tokenizer)
    result.update(step=step, stage=stage.index, stage_name=stage.name,
                  stage_seq_len=stage.seq_len)
    if jax.process_index() == 0:  # every process computes the grid; one writes it
      os.makedirs(self.out_dir, exist_ok=True)
      name = f"niah_stage{stage.index}"
      plots.save(plots.niah_figure(result), os.path.join(self.out_dir, name + ".png"))
      # Through a temp file and a rename: a killed run never leaves a half-written grid.
      write_result(os.path.join(self.out_dir, name + ".json"), result)
    return {"split": "niah", "stage_seq_len": stage.seq_len,
            "niah_lengths": result["lengths"], "niah_depths": result["depths"],
            "niah_accuracy": result["accuracy"], "niah_digit_accuracy": result["digit_accuracy"],
            "niah_mean_accuracy": result["mean_accuracy"]}
