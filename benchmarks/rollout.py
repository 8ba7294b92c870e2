"""Rollout throughput on the hybrid cache vs plain `Engine.generate` of as many tokens.

The tiny config (configs/tiny.py: 3 KDA + 1 MLA layers, MoE) with the chat byte vocabulary
(266 ids), random weights, fp32. Episodes are the arithmetic environment at levels 0..3:
  rollout_free     free sampling at temperature 1: a random model writes no valid action, so
                   each turn is cut at --max_turn_tokens and answered with the format error
                   (a tool-result turn prefilled into the same cache row), until the
                   environment's turn limit or --max_tokens; rows end at different times
  rollout_oracle   every turn forced from the oracle (calculator calls, then the answer):
                   real tool results, short turns, rows finishing early
  generate         Engine.generate over B prompts of the rollout's mean prompt length, as
                   many new tokens per row as rollout_free generated per episode (no stop
                   token): the same model, cache capacity and batch, one jitted while_loop
Each mode runs once to compile (excluded), then --repeats timed runs (the median is kept).
generated_tok_per_s counts sampled (or forced) assistant tokens; total_tok_per_s every token
fed to the cache (prompts and tool results included). ratio_vs_generate = the rollout's
generated tokens/s over generate's, both including their prefill.

  python benchmarks/rollout.py [--batch 8] [--max_turn_tokens 32] [--max_tokens 1024]
                               [--repeats 3]
Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np
from flax import nnx

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from hybridmoe_jax.config import model_config_from_dict  # pylint: disable=g-import-not-at-top
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.infer import Engine, SamplingConfig
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.rl.episode import EpisodeSpec, oracle_script
from hybridmoe_jax.rl.rollout import Rollout, RolloutConfig
from hybridmoe_jax.config.flags import load_config_file
from benchmarks._timing import time_fns


def episodes(batch: int, forced: bool) -> list[EpisodeSpec]:
  out = []
  for i in range(batch):
    spec = EpisodeSpec("arithmetic", 1000 + i, i % 4, group=i, sample_seed=i)
    out.append(EpisodeSpec(**{**spec.__dict__, "forced": oracle_script(spec)}) if forced
               else spec)
  return out


def timed(fn, repeats: int):
  """-> (result of the last run, median seconds of `repeats` runs after one warm-up)."""
  runs = []
  median = time_fns({"run": lambda: runs.append(fn()) or runs[-1]}, repeats)["run"][1]
  return runs[-1], median


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--max_turn_tokens", type=int, default=32)
  p.add_argument("--max_tokens", type=int, default=1024)
  p.add_argument("--prefill_chunk", type=int, default=128)
  p.add_argument("--repeats", type=int, default=3)
  a = p.parse_args()
  tok = ByteTokenizer(chat=True)
  base = load_config_file(os.path.join(_ROOT, "configs", "tiny.py")).model
  base.vocab_size = tok.vocab_size
  model = HybridLM(model_config_from_dict(base), rngs=nnx.Rngs(0))
  engine = Engine(model, max_len=a.max_tokens, prefill_chunk=a.prefill_chunk, kv_block=256)
  rollout = Rollout(engine, tok, RolloutConfig(
      max_tokens=a.max_tokens, max_turn_tokens=a.max_turn_tokens,
      sampling=SamplingConfig(temperature=1.0)), batch=a.batch)
  common = {"batch": a.batch, "max_turn_tokens": a.max_turn_tokens,
            "max_tokens": a.max_tokens, "prefill_chunk": a.prefill_chunk,
            "backend": jax.default_backend()}
  rows = {}
  for mode, forced in (("rollout_free", False), ("rollout_oracle", True)):
    specs = episodes(a.batch, forced)
    res, sec = timed(lambda specs=specs: rollout.run(specs), a.repeats)
    s = res.stats
    rows[mode] = {"mode": mode, "seconds": round(sec, 3),
                  "generated_tokens": s["generated_tokens"], "total_tokens": s["total_tokens"],
                  "generated_tok_per_s": round(s["generated_tokens"] / sec, 1),
                  "total_tok_per_s": round(s["total_tokens"] / sec, 1),
                  "model_calls": s["model_calls"], "chunk_calls": s.get("chunk_calls", 0),
                  "turns": sum(t.num_turns for t in res.finished),
                  "episode_lengths": sorted(len(t.ids) for t in res.finished),
                  "finish_reasons": sorted({t.finish_reason for t in res.finished}),
                  "env_s": round(s["env_s"], 4), **common}
    if mode == "rollout_free":
      prompt_len = int(np.mean([t.prompt_len for t in res.finished]))
      new = s["generated_tokens"] // a.batch
  prompts = np.random.default_rng(0).integers(0, 256, (a.batch, prompt_len), dtype=np.int32)
  out, sec = timed(lambda: engine.generate(prompts, max_new_tokens=new,
                                           sampling=SamplingConfig(temperature=1.0)),
                   a.repeats)
  gen = int(out.lengths.sum())
  rows["generate"] = {"mode": "generate", "seconds": round(sec, 3), "generated_tokens": gen,
                      "total_tokens": gen + a.batch * prompt_len,
                      "generated_tok_per_s": round(gen / sec, 1),
                      "total_tok_per_s": round((gen + a.batch * prompt_len) / sec, 1),
                      "prompt_len": prompt_len, **common}
  for mode in ("rollout_free", "rollout_oracle"):
    rows[mode]["ratio_vs_generate"] = round(
        rows[mode]["generated_tok_per_s"] / rows["generate"]["generated_tok_per_s"], 3)
  for row in rows.values():
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
