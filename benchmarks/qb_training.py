"""Quantile Balancing in the training loop: MaxVio curves with QB on vs balancing off.

  python benchmarks/qb_training.py                       # tiny config, 60 steps per run
  python benchmarks/qb_training.py --steps=100 --balancing=qb,sign,none

Each run trains configs/tiny.py on the bundled text in its own temporary workdir and logs
every step; the table reports the worst layer's MaxVio (max_j load_j / mean load - 1) at a
few steps and summarised over the last 20 steps.
"""

import json
import os
import tempfile

from absl import app
from absl import flags
from absl import logging
import numpy as np

from hybridmoe_jax.config.flags import load_config_file
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STEPS = flags.DEFINE_integer("steps", 60, "Steps per run.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Tokens per row.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows per step.")
_BAL = flags.DEFINE_list("balancing", ["qb", "none"], "Balancing rules to compare.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Keep the runs here (default: a temp dir).")
_JSON = flags.DEFINE_string("json_out", None, "Also write the summary as JSON here.")


def _tiny_config():
  return load_config_file(os.path.join(_ROOT, "configs", "tiny.py"))


def maxvio_curve(workdir: str) -> np.ndarray:
  """Per step, the largest MaxVio over MoE layers, from workdir/metrics.jsonl."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    for line in f:
      r = json.loads(line)
      if r.get("split") == "train":
        out[r["step"]] = max(layer["max_vio"] for layer in r["moe"].values())
  return np.array([out[s] for s in sorted(out)])


def run(balancing: str, workdir: str) -> dict:
  config = _tiny_config()
  config.model.moe.balancing = balancing
  t = config.train
  t.steps, t.seq_len, t.batch_size = _STEPS.value, _SEQ.value, _BATCH.value
  t.warmup = min(t.warmup, t.steps // 5)
  t.log_every, t.eval_every, t.eval_batches = 1, 0, 2
  t.checkpoint_every, t.heatmap_every = 0, 0
  t.maxvio_alert_steps = 10 ** 6
  s = train_and_evaluate(run_config_from_dict(config), workdir)
  curve = maxvio_curve(workdir)
  tail = curve[-min(20, len(curve)):]
  return {"balancing": balancing, "curve": curve.tolist(), "first": float(curve[0]),
          "tail_mean": float(tail.mean()), "tail_max": float(tail.max()),
          "loss": [s["first_loss"], s["last_loss"]], "tokens_per_sec": s["tokens_per_sec"]}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  root = _WORKDIR.value or tempfile.mkdtemp(prefix="qb_training_")
  results = [run(b, os.path.join(root, b)) for b in _BAL.value]
  marks = [s for s in (1, 5, 10, 20, 30, 40, 60, 100, 200) if s <= _STEPS.value]
  head = f"{'balancing':<10}" + "".join(f"{'@' + str(s):>8}" for s in marks)
  print(f"worst-layer MaxVio, tiny config, {_STEPS.value} steps of "
        f"{_BATCH.value}x{_SEQ.value} tokens")
  print(head + f"{'last20 mean':>13}{'last20 max':>12}{'loss':>16}")
  for r in results:
    row = "".join(f"{r['curve'][s - 1]:>8.3f}" for s in marks)
    print(f"{r['balancing']:<10}{row}{r['tail_mean']:>13.3f}{r['tail_max']:>12.3f}"
          f"{r['loss'][0]:>8.3f}->{r['loss'][1]:.3f}")
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(results, f)


if __name__ == "__main__":
  app.run(main)
