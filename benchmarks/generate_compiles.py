"""What `Engine.generate` compiles over a session of mixed calls: per batch bucket only,
against the exact-shape path (bucket=False, the behaviour before issue 48: one compile per
(batch size, max_new_tokens)).

The model: a training workdir / export given with --workdir (e.g. runs/default), else the
tiny config with random weights. The session: every (batch size, max_new_tokens) of
--batches x --new_tokens, in that order, greedy, prompts of 5-40 bytes. For each mode it
counts the traces of the jitted entry points (`infer.trace_counts`), the wall time of the
whole session and of the first call, and checks that both modes give the same tokens.

  python benchmarks/generate_compiles.py [--workdir runs/default] [--batches 1,2,3,4]
                                         [--new_tokens 16,32,64]
Prints one JSON line per mode, then a summary line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
# pylint: disable=g-import-not-at-top,wrong-import-position
from hybridmoe_jax import api
from hybridmoe_jax.config import model_config_from_dict
from hybridmoe_jax.config.flags import load_config_file
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.infer import Engine, trace_counts
from hybridmoe_jax.model import HybridLM
from benchmarks._timing import Stopwatch


def _model(workdir: str | None):
  if workdir:
    lm = api.load(workdir, max_len=256)
    return lm.model, lm.tokenizer
  from flax import nnx
  cfg = model_config_from_dict(load_config_file(os.path.join(_ROOT, "configs", "tiny.py")).model)
  return HybridLM(cfg, rngs=nnx.Rngs(0)), ByteTokenizer(chat=True)


def _session(model, tok, batches, new_tokens, bucket: bool) -> dict:
  jax.clear_caches()   # each mode compiles from nothing: neither reuses the other's programs
  engine = Engine(model, max_len=256, prefill_chunk=64, kv_block=64)
  rng = np.random.default_rng(0)
  before, outs, first = trace_counts(), [], None
  watch = Stopwatch()
  for b in batches:
    for n in new_tokens:
      rows = [tok.encode("".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(5, 41))),
                         bos=True) for _ in range(b)]
      lengths = np.asarray([len(r) for r in rows], np.int32)
      tokens = np.full((b, int(lengths.max())), tok.pad_id, np.int32)
      for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
      out = engine.generate(tokens, max_new_tokens=n, prompt_lengths=lengths,
                            pad_id=tok.pad_id, bucket=bucket)
      first = watch.seconds if first is None else first
      outs.append(out.tokens)
  watch.stop()
  wall = watch.seconds
  after = trace_counts()
  traces = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
  return {"bucket": bucket, "calls": len(batches) * len(new_tokens), "traces": traces,
          "wall_s": round(wall, 2), "first_call_s": round(first, 2), "outputs": outs}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", default=None)
  p.add_argument("--batches", default="1,2,3,4")
  p.add_argument("--new_tokens", default="16,32,64")
  a = p.parse_args()
  batches = [int(x) for x in a.batches.split(",")]
  new_tokens = [int(x) for x in a.new_tokens.split(",")]
  model, tok = _model(a.workdir)
  res = {}
  for bucket in (False, True):
    r = _session(model, tok, batches, new_tokens, bucket)
    res[bucket] = r
    print(json.dumps({k: v for k, v in r.items() if k != "outputs"}), flush=True)
  same = all(np.array_equal(x, y) for x, y in zip(res[False]["outputs"], res[True]["outputs"]))
  print(json.dumps({
      "summary": "generate compiles", "model": a.workdir or "tiny (random weights)",
      "outputs_equal": same,
      "generate_traces": {"exact": res[False]["traces"].get("generate", 0),
                          "bucketed": res[True]["traces"].get("generate", 0)},
      "wall_ratio_bucketed_over_exact": round(res[True]["wall_s"] / res[False]["wall_s"], 3)}))


if __name__ == "__main__":
  main()
