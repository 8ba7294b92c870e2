"""The dry run's memory model against XLA's own count, for one training step on one device.

For each preset, sequence length T and remat policy, the real jitted train step
(`train/step.py: make_train_step`, AdamW, batch B x T, fp32) is lowered on abstract
shapes and compiled; XLA's `compiled.memory_analysis()` gives its peak bytes as
  xla = arguments + outputs - aliased (the donated state) + temporaries.
`train/dry_run.py: stage_memory` gives the model's bytes for the same step (params,
gradients, optimizer, the residuals JAX keeps for the backward, one layer's recompute under
remat, attention workspace, logits). The ratio
xla / model says how far the model is from the compiler on this backend, in the same run.

  python benchmarks/memory_model.py [--presets tiny,small] [--lengths 1024,4096]
                                    [--remats none,full] [--batch 1]
Prints one JSON line per (preset, T, remat), then a table. Compilation only: nothing runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridmoe_jax.config.run import run_config_from_dict  # pylint: disable=g-import-not-at-top
from hybridmoe_jax.train import dry_run, optim
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.config.flags import load_config_file
from hybridmoe_jax.train.state import abstract_train_state
from hybridmoe_jax.train.step import make_train_step
from benchmarks._timing import Stopwatch

_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def one_device_run(preset: str, batch: int, seq_len: int, remat: str, overrides=None):
  """The preset's RunConfig for one device: mesh 1 x ... x 1, train batch B x T, `remat`."""
  config = load_config_file(os.path.join(_CONFIGS, f"{preset}.py"))
  config.compute.remat = remat
  config.compute.dtype = "float32"
  config.train.batch_size, config.train.seq_len, config.train.grad_accum = batch, seq_len, 1
  config.mesh.update(data=1, fsdp=1, expert=1, tensor=1, context=1)
  config.curriculum.stages = ()
  for key, value in (overrides or {}).items():
    section, field = key.split(".", 1)
    config[section][field] = value
  return run_config_from_dict(config)


def xla_bytes(run) -> dict[str, int]:
  """XLA's memory_analysis of the compiled train step of `run` (one device)."""
  schedule = optax.constant_schedule(1e-3)
  tx = optim.make_optimizer(run.train, schedule)
  graphdef, state = abstract_train_state(run.model, run.compute, tx, 0)
  step = make_train_step(graphdef, run.model, tx, grad_accum=1, schedule=schedule)
  shape = (run.train.batch_size, run.train.seq_len)
  batch = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
           "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32)}
  m = step.lower(state, batch).compile().memory_analysis()
  return {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
          "aliased": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes),
          "total": int(m.argument_size_in_bytes + m.output_size_in_bytes
                       - m.alias_size_in_bytes + m.temp_size_in_bytes)}


def model_bytes(run) -> dict[str, float]:
  """The dry run's components for the same step, and their total."""
  plan = plan_lib.build_plan(run)
  e = dry_run.estimate(run, plan)
  comps = dry_run.stage_memory(run, e, run.train.seq_len, run.train.batch_size)
  out = dict(comps[run.compute.remat])
  out["total"] = dry_run.step_bytes(out)
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--presets", default="tiny,small")
  p.add_argument("--lengths", default="1024,4096")
  p.add_argument("--remats", default="none,full")
  p.add_argument("--batch", type=int, default=1)
  args = p.parse_args(argv)
  rows = []
  for preset in args.presets.split(","):
    for t in (int(x) for x in args.lengths.split(",")):
      for remat in args.remats.split(","):
        run = one_device_run(preset, args.batch, t, remat)
        sw = Stopwatch()
        xla = xla_bytes(run)
        est = model_bytes(run)
        row = {"preset": preset, "T": t, "B": args.batch, "remat": remat,
               "backend": jax.default_backend(), "xla_total": xla["total"],
               "xla_temp": xla["temp"], "model_total": round(est["total"]),
               "ratio_xla_over_model": round(xla["total"] / est["total"], 3),
               "model": {k: round(v) for k, v in est.items() if k != "total"},
               "compile_s": round(sw.seconds, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
  print(f"\n{'preset':8} {'T':>6} {'remat':6} {'XLA MiB':>10} {'model MiB':>10} {'XLA/model':>9}")
  for r in rows:
    print(f"{r['preset']:8} {r['T']:>6} {r['remat']:6} {r['xla_total'] / 2**20:>10.1f} "
          f"{r['model_total'] / 2**20:>10.1f} {r['ratio_xla_over_model']:>9.2f}")


if __name__ == "__main__":
  main()
