"""Memory and time of one training step (forward + backward) of the tiny model at long T:
the dense MLA core (a [B, H, T, T] score matrix) against the blockwise one (O(T x block)).

configs/tiny.py (3 KDA + 1 MLA layers, 8 experts), batch 1, fp32, random tokens in one
document. For each T and core:
  temp_bytes   XLA's own count of the step's temporary buffers (compiled.memory_analysis())
  step_s       median of --repeats runs of the jitted value_and_grad (compile excluded);
               skipped (null) when temp_bytes exceeds --max_gib: that core would not fit
The ratio columns compare the two cores in the same run (blockwise / dense).

  python benchmarks/long_context.py [--lengths 8192,16384,32768,65536] [--repeats 2]
                                    [--max_gib 8] [--block 128]
Prints one JSON line per (T, core), then a table.

Inference at 1M tokens (chunked prefill time, peak RSS, decode ms/token) is measured by the
prefill / decode benchmark: `python benchmarks/decode.py --models hybrid --contexts 1048576
--decode_steps 64 --budget_s 1e9`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from hybridmoe_jax.config import ComputeConfig, model_config_from_dict  # pylint: disable=g-import-not-at-top
from hybridmoe_jax.model import HybridLM
from benchmarks._timing import time_fn
from hybridmoe_jax.config.flags import load_config_file


def step_fn(cfg, compute):
  """A jitted (tokens, segments) -> (loss, grads) of a fresh model with `compute`."""
  graphdef, params, rest = nnx.split(HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute),
                                     nnx.Param, ...)

  @jax.jit
  def step(params, tokens, seg):
    def loss(params):
      logits, _ = nnx.merge(graphdef, params, rest)(tokens, segment_ids=seg)
      logp = jax.nn.log_softmax(logits[:, :-1])
      return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return jax.value_and_grad(loss)(params)

  return step, params


def measure(cfg, compute, t, repeats, max_bytes):
  step, params = step_fn(cfg, compute)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, t)), jnp.int32)
  seg = jnp.ones((1, t), jnp.int32)
  compiled = step.lower(params, tokens, seg).compile()
  temp = int(compiled.memory_analysis().temp_size_in_bytes)
  if temp > max_bytes:
    return temp, None
  _, median = time_fn(compiled, (params, tokens, seg), repeats)
  return temp, median


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", default="8192,16384,32768,65536")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--max_gib", type=float, default=8.0)
  p.add_argument("--block", type=int, default=128)
  args = p.parse_args()
  cfg = model_config_from_dict(load_config_file(os.path.join(_ROOT, "configs", "tiny.py")).model)
  base = ComputeConfig(kda_chunk_size=64, mla_block=args.block)
  rows = []
  for t in (int(x) for x in args.lengths.split(",")):
    row = {"T": t}
    for core in ("dense", "blockwise"):
      temp, sec = measure(cfg, dataclasses.replace(base, mla_impl=core), t, args.repeats,
                          args.max_gib * 2**30)
      rec = {"bench": "long_context", "T": t, "core": core, "temp_bytes": temp, "step_s": sec,
             "backend": jax.default_backend()}
      print(json.dumps(rec), flush=True)
      row[core] = rec
    rows.append(row)
  print(f"{'T':>7} {'dense GiB':>10} {'block GiB':>10} {'mem ratio':>10} "
        f"{'dense s':>8} {'block s':>8} {'time ratio':>10}")
  for r in rows:
    d, b = r["dense"], r["blockwise"]
    ds = f"{d['step_s']:.2f}" if d["step_s"] else "OOM"
    tr = f"{b['step_s'] / d['step_s']:.2f}" if d["step_s"] and b["step_s"] else "-"
    print(f"{r['T']:>7} {d['temp_bytes'] / 2**30:>10.2f} {b['temp_bytes'] / 2**30:>10.2f} "
          f"{b['temp_bytes'] / d['temp_bytes']:>10.3f} {ds:>8} "
          f"{b['step_s'] or float('nan'):>8.2f} {tr:>10}")


if __name__ == "__main__":
  main()
