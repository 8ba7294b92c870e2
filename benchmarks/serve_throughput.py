"""Serving throughput and latency: the OpenAI server's continuous batching vs one-at-a-time
`generate`.

The tiny config (configs/tiny.py: 3 KDA + 1 MLA layers, MoE), random weights, the byte
tokenizer, fp32. R requests (prompts of random printable text, --min_prompt..--max_prompt
bytes; greedy; max_tokens --max_tokens; a request ends early only at EOS, identically in both
paths since greedy outputs are equal) are sent:
  reference       one at a time through `LoadedModel.generate` (the batch-1 engine: chunked
                  prefill + a compiled while_loop decode), in process;
  server c=1,4,16 through the official `openai` client (streaming, to time the first token)
                  against `python -m hybridmoe_jax.serve` in its own process on 127.0.0.1
                  (the same weights, saved as a params export), c requests in flight at once,
                  --slots cache rows (one Scheduler: prefill chunks interleaved with decode
                  steps of every running row).
Compilation is excluded (a warm-up request on each path). Per row: wall_s, completion tokens,
tok_per_s, ratio = tok_per_s / the reference's, request latency p50 / p90 and time to first
token p50 (s). The reference's tokens must equal the server's (checked).

  python benchmarks/serve_throughput.py [--requests 16] [--concurrency 1,4,16] [--slots 16]
      [--max_tokens 32] [--min_prompt 16] [--max_prompt 96] [--prefill_chunk 64]
Prints one JSON line per row, then a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
from flax import nnx

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from hybridmoe_jax.api import LoadedModel, load  # pylint: disable=g-import-not-at-top
from hybridmoe_jax.config import model_config_from_dict
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.config.flags import load_config_file
from hybridmoe_jax.train.params_export import export_params
from hybridmoe_jax.tools import timing
from hybridmoe_jax.tools.timing import Stopwatch, stopwatch


def _export(path: str) -> str:
  """The tiny model, random weights, as a params export (what the server process loads)."""
  cfg = model_config_from_dict(load_config_file(os.path.join(_ROOT, "configs", "tiny.py")).model)
  _, params, biases, _ = nnx.split(HybridLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, RoutingBias, ...)
  return export_params(path, params, biases, dataclasses.asdict(cfg))


@contextlib.contextmanager
def _server(path: str, *, slots: int, max_len: int, prefill_chunk: int):
  """`python -m hybridmoe_jax.serve` on a free port -> its base URL; stopped on exit."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen([sys.executable, "-m", "hybridmoe_jax.serve", f"--workdir={path}",
                           f"--port={port}", f"--slots={slots}", f"--max_len={max_len}",
                           f"--prefill_chunk={prefill_chunk}", "--model_name=tiny"], cwd=_ROOT)
  try:
    deadline = timing.now() + 300
    while True:
      try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).close()
        break
      except OSError:
        if proc.poll() is not None or timing.now() > deadline:
          raise SystemExit("the server did not start") from None
        time.sleep(0.5)
    yield f"http://127.0.0.1:{port}/v1"
  finally:
    proc.terminate()
    proc.wait(60)


def _prompts(n: int, lo: int, hi: int) -> list[str]:
  rng = np.random.default_rng(0)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz      ,."))
  return ["".join(rng.choice(letters, int(rng.integers(lo, hi + 1)))) for _ in range(n)]


def _pct(xs, q) -> float:
  return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def reference(lm: LoadedModel, prompts: list[str], max_tokens: int) -> dict:
  lm.generate(prompts[0], max_new_tokens=max_tokens)           # compile
  texts, lat = [], []
  with stopwatch() as all_sw:
    for p in prompts:
      with stopwatch() as sw:
        texts.append(lm.generate(p, max_new_tokens=max_tokens))
      lat.append(sw.seconds)
  wall = all_sw.seconds
  tokens = 0
  for p in prompts:          # completion tokens as the server counts them (EOS included)
    out = lm.engine.generate(lm.tokenizer.encode(p, bos=True)[None], max_new_tokens=max_tokens,
                             stop_tokens=(lm.tokenizer.eos_id,))
    tokens += int(out.lengths[0])
  return {"path": "generate one at a time", "concurrency": 1, "wall_s": wall,
          "tokens": tokens, "tok_per_s": tokens / wall, "latency_p50_s": _pct(lat, 50),
          "latency_p90_s": _pct(lat, 90), "ttft_p50_s": float("nan"), "texts": texts}


def served(client, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
  def one(p):
    sw = Stopwatch()
    first, text, tokens = None, "", 0
    for chunk in client.completions.create(model="tiny", prompt=p, max_tokens=max_tokens,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
      if chunk.choices and first is None:
        first = sw.seconds
      if chunk.choices:
        text += chunk.choices[0].text
      if chunk.usage is not None:
        tokens = chunk.usage.completion_tokens
    return text, tokens, sw.seconds, first

  with stopwatch() as all_sw, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    results = list(pool.map(one, prompts))
  wall = all_sw.seconds
  tokens = sum(r[1] for r in results)
  return {"path": "server", "concurrency": concurrency, "wall_s": wall, "tokens": tokens,
          "tok_per_s": tokens / wall, "latency_p50_s": _pct([r[2] for r in results], 50),
          "latency_p90_s": _pct([r[2] for r in results], 90),
          "ttft_p50_s": _pct([r[3] for r in results if r[3] is not None], 50),
          "texts": [r[0] for r in results]}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--requests", type=int, default=16)
  ap.add_argument("--concurrency", default="1,4,16")
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--max_tokens", type=int, default=32)
  ap.add_argument("--min_prompt", type=int, default=16)
  ap.add_argument("--max_prompt", type=int, default=96)
  ap.add_argument("--prefill_chunk", type=int, default=64)
  args = ap.parse_args()
  import openai
  max_len = args.max_prompt + 1 + args.max_tokens
  with tempfile.TemporaryDirectory(prefix="serve_bench_") as tmp:
    path = _export(os.path.join(tmp, "tiny"))
    lm = load(path, max_len=max_len, prefill_chunk=args.prefill_chunk)
    prompts = _prompts(args.requests, args.min_prompt, args.max_prompt)
    ref = reference(lm, prompts, args.max_tokens)
    rows = [ref]
    with _server(path, slots=args.slots, max_len=max_len, prefill_chunk=args.prefill_chunk) as url:
      client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
      served(client, prompts[:1], args.max_tokens, 1)                # compile
      for c in [int(x) for x in args.concurrency.split(",")]:
        row = served(client, prompts, args.max_tokens, c)
        if row["texts"] != ref["texts"] or row["tokens"] != ref["tokens"]:
          raise SystemExit(f"concurrency {c}: the server's outputs differ from generate's")
        rows.append(row)
  for row in rows:
    row.pop("texts")
    row.update(ratio=row["tok_per_s"] / ref["tok_per_s"], slots=args.slots,
               requests=args.requests, max_tokens=args.max_tokens)
    print(json.dumps(row), flush=True)
  print(f"\n{'path':24} {'conc':>4} {'tok/s':>8} {'ratio':>6} {'p50 s':>7} {'p90 s':>7} "
        f"{'ttft s':>7}")
  for r in rows:
    print(f"{r['path']:24} {r['concurrency']:>4} {r['tok_per_s']:>8.1f} {r['ratio']:>6.2f} "
          f"{r['latency_p50_s']:>7.3f} {r['latency_p90_s']:>7.3f} {r['ttft_p50_s']:>7.3f}")


if __name__ == "__main__":
  main()
