"""Peak host memory of a Hugging Face -> ours (and back) conversion, at full scale, without
the weights: the checkpoint is written from abstract shapes as sparse files (real headers,
data left as holes; `write_sparse_hf_checkpoint`), the outputs' zero chunks become holes
too, so only memory and the reading of zeros are measured.

  python benchmarks/convert_memory.py                  # the Kimi-Linear-48B layout (~98 GB)
  python benchmarks/convert_memory.py --scale=small    # a ~0.3 GB layout (seconds)
  python benchmarks/convert_memory.py --reverse        # also ours -> HF from the export

Each conversion runs as `python -m hybridmoe_jax.convert` in a fresh process, which reports
its peak RSS (VmHWM); the baseline is the same process's imports alone. Prints one JSON line per
direction: peak, baseline, peak - baseline, the largest tensor of the input and of the output
layout, the total size, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Iterator

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hybridmoe_jax.convert import hf_config, hf_weights  # noqa: E402  pylint: disable=wrong-import-position
from hybridmoe_jax.convert.convert import (CONFIG_JSON, KEEP_F32,  # noqa: E402  pylint: disable=wrong-import-position
                                           SHARD_BYTES)
from hybridmoe_jax.io.safetensors import DTYPES, ShardedWriter, Spec  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks._timing import stopwatch  # noqa: E402  pylint: disable=wrong-import-position

BASELINE = ("from hybridmoe_jax.convert import __main__ as m, convert; "
            "print(m.peak_rss_bytes())")

_ZERO_CHUNK = 64 * 2**20


def _zeros(spec: Spec) -> Iterator[np.ndarray]:
  left, dt = spec.nbytes, DTYPES[spec.dtype]
  while left:
    n = min(left, _ZERO_CHUNK)
    yield np.zeros(n // dt.itemsize, dt)
    left -= n


def hf_specs(hf: dict[str, Any], dtype: str = "BF16") -> list[Spec]:
  """Every tensor of the Kimi-Linear checkpoint `hf` (a config.json dict), in file order:
  weights in `dtype`, A_log / dt_bias / the correction biases float32 (as released)."""
  rules = hf_weights.weight_rules(hf_config.model_config_from_hf(hf))
  return [Spec(n, "F32" if n.endswith(KEEP_F32) else dtype, r.shapes[n])
          for r, n in hf_weights.outputs(rules, to="hf")]


def write_sparse_hf_checkpoint(path: str, hf: dict[str, Any], *, dtype: str = "BF16",
                               shard_bytes: int = SHARD_BYTES) -> dict[str, int]:
  """A checkpoint of `hf`'s layout without real weights, at `path` (new dir): config.json
  and every tensor's header entry with its true shape and dtype, the data region left as
  holes of a sparse file (all zeros, no disk blocks).

  Returns {"tensors", "bytes" (the logical size), "largest_tensor_bytes"}.
  """
  os.makedirs(path)
  specs = hf_specs(hf, dtype)
  writer = ShardedWriter(path, specs, prefix="model", max_shard_bytes=shard_bytes, sparse=True)
  for s in specs:
    writer.write(s.name, _zeros(s))
  writer.close()
  with open(os.path.join(path, CONFIG_JSON), "x", encoding="utf-8") as f:
    json.dump(hf, f, indent=1)
  return {"tensors": len(specs), "bytes": sum(s.nbytes for s in specs),
          "largest_tensor_bytes": max(s.nbytes for s in specs)}


def kimi_48b_hf() -> dict:
  """The 48B preset (configs/kimi_linear_48b.py) as a Kimi-Linear config.json."""
  from configs.kimi_linear_48b import get_config  # pylint: disable=import-outside-toplevel
  from hybridmoe_jax.config import model_config_from_dict  # pylint: disable=import-outside-toplevel
  return hf_config.hf_config_from_model(model_config_from_dict(get_config().model))


def scaled(hf: dict, scale: str) -> dict:
  """The 48B layout shrunk (same structure, smaller widths / counts) for quick runs."""
  if scale == "full":
    return hf
  out = dict(hf, vocab_size=32768, hidden_size=512, num_hidden_layers=6, num_experts=64,
             moe_intermediate_size=256, intermediate_size=1024, kv_lora_rank=128,
             num_attention_heads=8)
  out["linear_attn_config"] = dict(hf["linear_attn_config"], num_heads=8, head_dim=64,
                                   kda_layers=[1, 2, 3, 5], full_attn_layers=[4, 6])
  return out


def run(cmd: list[str]) -> tuple[dict, float]:
  with stopwatch() as sw:
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False,
                       env=dict(os.environ, PYTHONPATH=ROOT))
  if p.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
  return json.loads(p.stdout.strip().splitlines()[-1]), sw.seconds


def measure(scale: str, reverse: bool, workdir: str) -> list[dict]:
  hf = scaled(kimi_48b_hf(), scale)
  src, ours, back = (os.path.join(workdir, n) for n in ("hf", "ours", "hf_back"))
  made = write_sparse_hf_checkpoint(src, hf)
  base = subprocess.run([sys.executable, "-c", BASELINE], cwd=ROOT, capture_output=True,
                        text=True, check=True, env=dict(os.environ, PYTHONPATH=ROOT))
  baseline = int(base.stdout.strip())
  rows = []
  steps = [("hf->ours", ["--from_hf", src, "--to", ours], made["largest_tensor_bytes"])]
  if reverse:
    steps.append(("ours->hf", ["--to_hf", back, "--from", ours], None))
  for name, args, largest_in in steps:
    summary, wall = run([sys.executable, "-m", "hybridmoe_jax.convert", *args])
    if largest_in is None:   # the reverse reads our layout: its largest is the stacked experts
      largest_in = rows[0]["largest_out_bytes"]
    rows.append({"direction": name, "scale": scale, "total_bytes": summary["bytes"],
                 "largest_in_bytes": largest_in,
                 "largest_out_bytes": summary["largest_tensor_bytes"],
                 "peak_rss_bytes": summary["peak_rss_bytes"], "baseline_rss_bytes": baseline,
                 "peak_minus_baseline_bytes": summary["peak_rss_bytes"] - baseline,
                 "tensors": summary["tensors"], "wall_s": round(wall, 1)})
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--scale", choices=("full", "small"), default="full")
  p.add_argument("--reverse", action="store_true", help="also convert the export back to HF")
  p.add_argument("--dir", help="work directory (default: a temporary one, removed after)")
  args = p.parse_args()
  if args.dir:
    rows = measure(args.scale, args.reverse, args.dir)
  else:
    with tempfile.TemporaryDirectory() as d:
      rows = measure(args.scale, args.reverse, d)
  for r in rows:
    print(json.dumps(r))


if __name__ == "__main__":
  main()
