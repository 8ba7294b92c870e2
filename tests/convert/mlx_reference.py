"""Run a Kimi-Linear HF dir through mlx-lm's kimi_linear (float32) and save its outputs.

Usage (with a python that has mlx_lm): python mlx_reference.py HF_DIR TOKENS.npy N_NEW OUT.npz
OUT.npz: logits [T, V] float32 of the prompt, greedy [N_NEW] int32 (greedy continuation
with mlx-lm's own caches). Only mlx-lm's model code is used (its ModelArgs, sanitize and
load_weights), so this is an independent reading of the same files.
"""

import glob
import json
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models import kimi_linear


def main(hf_dir, tokens_file, n_new, out_file):
  with open(f"{hf_dir}/config.json") as f:
    config = json.load(f)
  model = kimi_linear.Model(kimi_linear.ModelArgs.from_dict(config))
  weights = {}
  for file in sorted(glob.glob(f"{hf_dir}/*.safetensors")):
    weights.update(mx.load(file))
  weights = {k: v.astype(mx.float32) for k, v in model.sanitize(weights).items()}
  model.load_weights(list(weights.items()), strict=True)
  model.eval()
  tokens = np.load(tokens_file).astype(np.int32)
  logits = model(mx.array(tokens)[None])[0]
  mx.eval(logits)
  cache = model.make_cache()
  step = model(mx.array(tokens)[None], cache=cache)[:, -1]
  greedy = []
  for _ in range(int(n_new)):
    nxt = mx.argmax(step, axis=-1)
    greedy.append(int(nxt.item()))
    step = model(nxt[None], cache=cache)[:, -1]
  np.savez(out_file, logits=np.array(logits, np.float32), greedy=np.array(greedy, np.int32))


if __name__ == "__main__":
  main(*sys.argv[1:])
