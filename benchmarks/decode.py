"""Decode cost vs context: cache bytes, ms per decoded token and time to first token (TTFT).

The tiny config (configs/tiny.py: 3 KDA + 1 MLA layers) against an all-MLA model of the same
widths and MoE, batch 1, fp32, random weights and tokens. For each context length L:
  cache_bytes    a cache sized for exactly L tokens (KDA: constant; MLA: L (d_c + Dr) layers
                 bytes, asserted here and in tests/infer/test_cache.py)
  ttft_s         chunked prefill of L tokens (--prefill_chunk per jitted step) + first sample
  peak_rss_gib   the process's peak resident memory after that L (the 1M-token target:
                 `--models hybrid --contexts 1048576 --decode_steps 64 --budget_s 1e9`, < 8 GiB)
  decode_ms      median over --decode_steps jitted decode steps right after that prefill
One engine per model (capacity max(L) + steps) serves every L: compilation is excluded and
the MLA attention reads only the filled blocks, so time follows L, not the capacity.

  python benchmarks/decode.py [--contexts 1024,4096,16384,65536] [--decode_steps 32]
                              [--prefill_chunk 2048] [--budget_s 600]
Prints one JSON line per (model, L), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from hybridmoe_jax.config import model_config_from_dict  # pylint: disable=g-import-not-at-top
from hybridmoe_jax.infer import Engine, cache_bytes, init_cache, mla_bytes_per_token
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.config.flags import load_config_file
from benchmarks import _timing as timing
from benchmarks._timing import stopwatch, time_fns


def model_configs():
  base = load_config_file(os.path.join(_ROOT, "configs", "tiny.py")).model
  hybrid = model_config_from_dict(base)
  base.layer_kinds = ("mla",) * hybrid.num_layers
  return {"hybrid": hybrid, "all_mla": model_config_from_dict(base)}


def _block(x):
  jax.tree.map(lambda a: a.block_until_ready(), x)


def bench_model(name, cfg, contexts, steps, chunk, kv_block, deadline):
  model = HybridLM(cfg, rngs=nnx.Rngs(0))
  engine = Engine(model, max_len=max(contexts) + steps, prefill_chunk=chunk, kv_block=kv_block)
  # Warm-up compiles prefill and decode for this capacity (excluded from all timings).
  with stopwatch() as sw:
    _, cache = engine.prefill(np.zeros((1, 1), np.int32))
    _block(engine.decode_step(jnp.zeros((1,), jnp.int32), cache))
  compile_s = sw.seconds
  rng = np.random.default_rng(0)
  rows = []
  for ctx in contexts:
    if timing.now() > deadline:
      print(f"# {name}: time budget spent, skipping L >= {ctx}", file=sys.stderr)
      break
    tokens = rng.integers(0, 256, (1, ctx), dtype=np.int32)
    with stopwatch() as sw:
      logits, cache = engine.prefill(tokens)
      first = int(jnp.argmax(logits[0]))
    ttft = sw.seconds
    state = [jnp.array([first], jnp.int32), cache]    # (token, cache), advanced by each step

    def step():
      logits, state[1] = engine.decode_step(*state)
      state[0] = jnp.argmax(logits, -1).astype(jnp.int32)
      return state[0]
    # median: robust to a shared, busy CPU
    decode_ms = time_fns({"decode": step}, steps, warmup=0)["decode"][1] * 1e3
    sized = cache_bytes(init_cache(cfg, 1, ctx))
    # The contract: KDA state constant, MLA cache exactly (d_c + Dr) * layers * bytes / token.
    assert sized["mla"] == ctx * mla_bytes_per_token(cfg), sized
    assert sized["kda"] == cache_bytes(init_cache(cfg, 1, 1))["kda"], sized
    rows.append({"model": name, "context": ctx, "cache_bytes": sized["total"],
                 "kda_bytes": sized["kda"], "mla_bytes": sized["mla"],
                 "mla_bytes_per_token": mla_bytes_per_token(cfg), "ttft_s": round(ttft, 4),
                 "prefill_tok_per_s": round(ctx / ttft, 1), "decode_ms": round(decode_ms, 3),
                 "compile_s": round(compile_s, 2), "prefill_chunk": chunk,
                 # the process's peak so far (Linux: KiB): one model and L per process
                 # (--models hybrid --contexts L) makes it the peak of that L alone
                 "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                       / 2**20, 3),
                 "backend": jax.default_backend()})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--contexts", default="1024,4096,16384,65536")
  p.add_argument("--decode_steps", type=int, default=32)
  p.add_argument("--prefill_chunk", type=int, default=2048)
  p.add_argument("--kv_block", type=int, default=1024)
  p.add_argument("--models", default="hybrid,all_mla")
  p.add_argument("--budget_s", type=float, default=600.0, help="per model; larger L skipped")
  a = p.parse_args()
  contexts = sorted(int(c) for c in a.contexts.split(","))
  configs = model_configs()
  rows = []
  for name in a.models.split(","):
    rows += bench_model(name, configs[name], contexts, a.decode_steps, a.prefill_chunk,
                        a.kv_block, timing.now() + a.budget_s)
  print(f"\n{'model':>8} {'context':>8} {'cache KiB':>10} {'TTFT s':>8} {'prefill tok/s':>13} "
        f"{'decode ms/tok':>13}")
  for r in rows:
    print(f"{r['model']:>8} {r['context']:>8} {r['cache_bytes'] / 1024:>10.1f} "
          f"{r['ttft_s']:>8.2f} {r['prefill_tok_per_s']:>13.0f} {r['decode_ms']:>13.2f}")


if __name__ == "__main__":
  main()
