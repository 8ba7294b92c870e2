"""Curriculum input pipeline throughput per stage vs the model's consumption rate.

  python benchmarks/data_pipeline.py                          # configs/curriculum_cpu.py
  python benchmarks/data_pipeline.py --batches=40 --workers=0,2 --model_steps=3

For every stage of the curriculum preset: batches/s and tokens/s of the grain pipeline
(sources -> mix -> tokenize -> first-fit pack -> batch) with 0 workers (one prefetch thread)
and with N worker processes (`mp_prefetch`), timed over `--batches` batches after the first
(which pays for process start-up and the first pack). Then the tokens/s that the tiny model's
jitted train step consumes at that stage's [batch, seq_len] (median of `--model_steps` steps
after compilation). ratio = pipeline tokens/s / model tokens/s: above 1 the input pipeline
keeps up.
"""

import json
import os
import sys

from absl import app
from absl import flags
import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
from benchmarks._timing import stopwatch, time_fns  # pylint: disable=g-import-not-at-top
_CONFIG = flags.DEFINE_string("config", os.path.join(_ROOT, "configs", "curriculum_cpu.py"),
                              "Curriculum preset.")
_BATCHES = flags.DEFINE_integer("batches", 30, "Timed batches per stage and setting.")
_WORKERS = flags.DEFINE_list("workers", ["0", "2"], "Worker counts to compare.")
_MODEL_STEPS = flags.DEFINE_integer("model_steps", 3, "Timed train steps per stage (0: skip).")
_JSON = flags.DEFINE_string("json_out", None, "Also write the rows as JSON here.")


def pipeline_rate(stage, data, workers: int, batches: int) -> tuple[float, float]:
  """(batches/s, tokens/s) of one stage's pipeline with `workers` processes."""
  from hybridmoe_jax.data import stages  # pylint: disable=g-import-not-at-top
  ds = stages.make_stage_dataset(stage, tokenizer=data.tokenizer, num_workers=workers,
                                 num_packing_bins=16)
  it = iter(ds)
  next(it)  # start-up: worker processes, first pack
  with stopwatch() as sw:
    for _ in range(batches):
      next(it)
  dt = sw.seconds
  if hasattr(it, "close"):
    it.close()
  return batches / dt, batches * stage.batch_size * stage.seq_len / dt


def model_rate(config, stage, steps: int) -> float:
  """Tokens/s of the jitted train step at the stage's shape (after compilation)."""
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.train import optim
  from hybridmoe_jax.train import stage_plan as plan_lib
  from hybridmoe_jax.train import step as step_lib
  from hybridmoe_jax.train.state import create_train_state
  cfg, t = config.model, config.train
  schedule = plan_lib.build_plan(config).schedule()
  tx = optim.make_optimizer(t, schedule)
  graphdef, state = create_train_state(cfg, config.compute, tx, t.seed)
  train_step = step_lib.make_train_step(graphdef, cfg, tx, grad_accum=t.grad_accum,
                                        schedule=schedule)
  rng = np.random.default_rng(0)
  batch = {"tokens": rng.integers(0, 256, (stage.batch_size, stage.seq_len), dtype=np.int32),
           "segment_ids": np.ones((stage.batch_size, stage.seq_len), np.int32)}
  box = [state]

  def step():
    box[0], m = train_step(box[0], batch)
    return m["loss"]
  median = time_fns({"step": step}, steps)["step"][1]   # one warm-up step compiles
  return stage.batch_size * stage.seq_len / median


def main(argv):
  del argv
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.config.run import run_config_from_dict
  from hybridmoe_jax.config.flags import load_config_file
  from hybridmoe_jax.train import stage_plan as plan_lib
  from hybridmoe_jax.train.run_inputs import build_data
  config = run_config_from_dict(load_config_file(_CONFIG.value))
  data = build_data(config, plan_lib.build_plan(config))
  rows = []
  print(f"load average at start: {os.getloadavg()}", flush=True)
  print("| stage | seq_len x batch | workers | batches/s | tokens/s | model tokens/s | ratio |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for stage in data.train.stages:
    model = model_rate(config, stage, _MODEL_STEPS.value) if _MODEL_STEPS.value else float("nan")
    for w in (int(x) for x in _WORKERS.value):
      bps, tps = pipeline_rate(stage, data, w, _BATCHES.value)
      row = dict(stage=stage.index, seq_len=stage.seq_len, batch=stage.batch_size, workers=w,
                 batches_per_s=bps, tokens_per_s=tps, model_tokens_per_s=model,
                 ratio=tps / model)
      rows.append(row)
      print(f"| {stage.index} | {stage.seq_len} x {stage.batch_size} | {w} | {bps:.1f} | "
            f"{tps / 1e3:.1f}k | {model / 1e3:.1f}k | {tps / model:.1f} |", flush=True)
  print(f"load average at end: {os.getloadavg()}", flush=True)
  if _JSON.value:
    with open(_JSON.value, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  app.run(main)
