"""Driver of benchmarks/accelerator.sh: the train-step timing and the BENCHMARKS.md rows.

  python benchmarks/accelerator.py train --presets tiny small --batch 8 --seq 2048 --out F
      times the jitted train step (median of --steps after one compiled warm-up step) of
      each preset on one device, bf16 compute, and appends one JSON line per preset to F
      (tokens/s = batch * seq / step time).
  python benchmarks/accelerator.py rows --jsonl DIR/*.jsonl --out DIR/benchmarks_rows.md
      turns the JSON lines of every part (train, kda_kernels, decode, moe_dispatch) into
      markdown table rows for BENCHMARKS.md, each headed by the device and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from benchmarks.memory_model import one_device_run  # noqa: E402  pylint: disable=g-import-not-at-top
from hybridmoe_jax.train import optim  # noqa: E402
from hybridmoe_jax.train.state import create_train_state  # noqa: E402
from hybridmoe_jax.train.step import make_train_step  # noqa: E402
from benchmarks._timing import time_fns  # noqa: E402


def time_train_step(preset: str, batch: int, seq: int, steps: int, dtype: str) -> dict:
  run = one_device_run(preset, batch, seq, "none", {"compute.dtype": dtype})
  schedule = optax.constant_schedule(1e-4)
  tx = optim.make_optimizer(run.train, schedule)
  graphdef, state = create_train_state(run.model, run.compute, tx, 0)
  step = make_train_step(graphdef, run.model, tx, grad_accum=1, schedule=schedule)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, run.model.vocab_size, (batch, seq)), jnp.int32)
  seg = jnp.asarray(np.repeat(np.arange(4), -(-seq // 4))[None, :seq].repeat(batch, 0),
                    jnp.int32)  # four packed documents per row
  b = {"tokens": tokens, "segment_ids": seg}
  box = [state, None]   # (train state, metrics), advanced by each step

  def run():
    box[0], box[1] = step(box[0], b)
    return box[1]
  compile_s, median = time_fns({"step": run}, steps)["step"]
  ms, metrics = median * 1e3, box[1]
  return dict(bench="train_step", preset=preset, batch=batch, seq=seq, dtype=dtype,
              backend=jax.default_backend(), device=jax.devices()[0].device_kind,
              step_ms=round(ms, 2), tokens_per_s=round(batch * seq / ms * 1e3, 1),
              compile_s=round(compile_s, 1), loss=float(metrics["loss"]))


def _rows(lines: list[dict]) -> str:
  """Markdown rows per part; unknown JSON lines are listed raw."""
  out = []
  by = {}
  for r in lines:
    by.setdefault(r.get("bench", r.get("impl") and "kda_kernels") or "other", []).append(r)
  for part, rs in by.items():
    keys = [k for k in rs[0] if not isinstance(rs[0][k], (dict, list))]
    out.append(f"\n#### {part}\n\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rs]
  return "\n".join(out) + "\n"


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  t = sub.add_parser("train")
  t.add_argument("--presets", nargs="+", default=["tiny", "small"])
  t.add_argument("--batch", type=int, default=8)
  t.add_argument("--seq", type=int, default=2048)
  t.add_argument("--steps", type=int, default=5)
  t.add_argument("--dtype", default="bfloat16")
  t.add_argument("--out", required=True)
  r = sub.add_parser("rows")
  r.add_argument("--jsonl", nargs="+", required=True)
  r.add_argument("--header", default="")
  r.add_argument("--out", required=True)
  a = p.parse_args(argv)
  if a.cmd == "train":
    for preset in a.presets:
      row = time_train_step(preset, a.batch, a.seq, a.steps, a.dtype)
      print("JSON " + json.dumps(row), flush=True)
      with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    return
  lines = []
  for path in a.jsonl:
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          line = line.strip().removeprefix("JSON ")
          if line.startswith("{"):
            lines.append(json.loads(line))
  with open(a.out, "w") as f:
    f.write(a.header + "\n" + _rows(lines))
  print(f"wrote {len(lines)} rows to {a.out}")


if __name__ == "__main__":
  main()
