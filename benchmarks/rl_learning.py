"""Does RL learn? Held-out success before / after RL from one SFT warm start, per algorithm
and seed, on the tiny model (configs/rl_tiny.py), 2-core CPU friendly.

  python benchmarks/rl_learning.py --out=/tmp/rl_bench --seeds=0,1,2 \
      --algos=grpo,drgrpo,opmd --iterations=100

Per seed: one SFT-only run (rl.iterations = 0; seed = train.seed = rl.seed), then one RL
run per algorithm started from it (`rl.init_from`), all with the same iterations, groups and
learning rate (equal budget). Each RL run evaluates greedily on the same held-out episodes at
iteration 0 (= the SFT model) and every `--eval_every` iterations. Prints one JSON line per
run ({"seed", "algo", "before": {cell: success}, "after": ..., "gain": ..., "promotions",
"frontier", "wall_s", "rollout_tok_s", "learner_step_s"}) and a summary table; `--json`
writes them all to a file. Algorithms:
  grpo    advantage grpo,   clipped ratio (eps 0.2 / 0.28), token-mean
  drgrpo  advantage drgrpo, clipped ratio, seq-mean-token-sum-norm (no length / std bias)
  gspo    advantage grpo,   sequence ratio clipped at rl.gspo_eps_low / high (3e-4 / 4e-4)
  opmd    Kimi k1.5 policy mirror descent (squared regression, tau = --opmd_tau)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.rl import trainer  # noqa: E402
from hybridmoe_jax.config.flags import load_config_file  # noqa: E402
from benchmarks._timing import stopwatch  # noqa: E402

ALGOS = {
    "grpo": dict(advantage="grpo", loss="clip", loss_agg_mode="token-mean"),
    "drgrpo": dict(advantage="drgrpo", loss="clip", loss_agg_mode="seq-mean-token-sum-norm"),
    "gspo": dict(advantage="grpo", loss="gspo", loss_agg_mode="seq-mean-token-mean"),
    "opmd": dict(advantage="drgrpo", loss="opmd"),
}


def _config(args, seed: int, **rl):
  config = load_config_file(args.config)
  config.train.seed = seed
  config.rl.seed = seed
  if args.sft_steps is not None:
    config.rl.sft_steps = args.sft_steps
  if args.sft_levels:
    config.rl.sft_levels = tuple(int(x) for x in args.sft_levels.split(","))
  if rl.get("iterations", 1) and args.start_level is not None:   # RL only, not the SFT
    for env in config.rl.envs.values():
      env["start_level"] = args.start_level
  if rl.get("iterations", 1) and args.curriculum_target is not None:
    config.rl.curriculum_target = args.curriculum_target
  for k, v in rl.items():
    setattr(config.rl, k, v)
  return config


def _records(workdir: str, event: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r["event"] == event]


def _sft_finished(workdir: str, steps: int | None) -> bool:
  """The SFT warm start in `workdir` logged its last step (`steps`; None: the config's)."""
  if steps is None or not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    return False
  return any(r.get("step") == steps for r in _records(workdir, "sft"))


def _success(rec: dict) -> dict[str, float]:
  return {k.split("/", 1)[1]: v for k, v in rec.items() if k.startswith("success/")}


def run(args) -> list[dict]:
  out = []
  for seed in args.seeds:
    tag = f"{args.sft_steps or ''}" + (f"L{args.sft_levels.replace(',', '')}"
                                       if args.sft_levels else "")
    sft_dir = os.path.join(args.out, f"sft{tag}_s{seed}")
    with stopwatch() as sw:
      if not _sft_finished(sft_dir, args.sft_steps):   # a finished warm start is reused as is
        trainer.train_rl(run_config_from_dict(_config(args, seed, iterations=0, eval_every=0)),
                         sft_dir)
    if args.sft_steps and not _sft_finished(sft_dir, args.sft_steps):
      sys.exit(f"{sft_dir}: the warm start stopped before step {args.sft_steps} (a signal?); "
               "run again to resume it")
    sft_s = sw.seconds
    for algo in args.algos:
      start = "" if args.start_level is None else f"_start{args.start_level}"
      start += "" if args.curriculum_target is None else f"_target{args.curriculum_target:g}"
      workdir = os.path.join(args.out, f"{algo}{tag}{start}_s{seed}")
      rl = dict(ALGOS[algo], init_from=sft_dir, iterations=args.iterations,
                eval_every=args.eval_every, eval_episodes=args.eval_episodes,
                eval_levels=tuple(int(x) for x in args.eval_levels.split(",")),
                group_size=args.group_size, opmd_tau=args.opmd_tau)
      with stopwatch() as sw:
        s = trainer.train_rl(run_config_from_dict(_config(args, seed, **rl)), workdir)
      wall = sw.seconds
      evals = _records(workdir, "eval")
      steps = _records(workdir, "rl")
      before, after = _success(evals[0]), _success(evals[-1])
      gen = sum(r.get("generated_tokens", 0) * r.get("episodes", 0) for r in steps)
      roll = sum(r.get("rollout_s", 0) for r in steps)
      learn = [r["learner_s"] / r["updates"] for r in steps if r.get("updates")]
      rec = {"seed": seed, "algo": algo, "iterations": args.iterations,
             "sft_steps": args.sft_steps, "sft_loss": _records(sft_dir, "sft")[-1]["loss"],
             "before": before, "after": after,
             "gain": {c: after[c] - before[c] for c in before},
             "curve": [{"iteration": int(e["iteration"]), **_success(e)} for e in evals],
             "promotions": int(sum(r.get("promotions", 0) for r in steps)),
             "frontier": s["curriculum"], "sft_s": sft_s, "wall_s": wall,
             "rollout_generated_tok_s": gen / max(roll, 1e-9),
             "learner_step_s": float(np.median(learn)) if learn else None}
      print(json.dumps(rec), flush=True)
      out.append(rec)
  return out


def table(records: list[dict], cell: str) -> str:
  lines = [f"held-out greedy success, {cell}: before -> after (gain)"]
  algos = sorted({r["algo"] for r in records}, key=list(ALGOS).index)
  for algo in algos:
    rs = [r for r in records if r["algo"] == algo]
    gains = [r["gain"].get(cell, float("nan")) for r in rs]
    per = ", ".join(f"s{r['seed']}: {r['before'].get(cell, 0):.2f}->{r['after'].get(cell, 0):.2f}"
                    for r in rs)
    lines.append(f"  {algo:7s} mean gain {np.mean(gains):+.3f}   ({per})")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="directory for the runs; a run already there "
                 "is resumed (finished: reused), never overwritten")
  p.add_argument("--config", default=str(ROOT / "configs" / "rl_tiny.py"))
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--algos", default="grpo,drgrpo,opmd")
  p.add_argument("--iterations", type=int, default=100)
  p.add_argument("--eval_every", type=int, default=25)
  p.add_argument("--eval_levels", default="0,1,2")
  p.add_argument("--eval_episodes", type=int, default=64)
  p.add_argument("--group_size", type=int, default=8)
  p.add_argument("--sft_steps", type=int, default=None, help="default: the config's")
  p.add_argument("--sft_levels", default="", help="e.g. 0,1,2,3; default: the config's")
  p.add_argument("--start_level", type=int, default=None,
                 help="the curriculum's first frontier of every env; default: the config's")
  p.add_argument("--curriculum_target", type=float, default=None,
                 help="the success rate the curriculum samples levels near (rl.curriculum_target);"
                      " default: the config's")
  p.add_argument("--opmd_tau", type=float, default=1.0)
  p.add_argument("--cell", default="arithmetic/L1", help="the cell of the summary table")
  p.add_argument("--json", default=None, help="also write all records here")
  args = p.parse_args()
  args.seeds = [int(s) for s in args.seeds.split(",")]
  args.algos = [a for a in args.algos.split(",") if a]   # empty: the SFT warm starts only
  bad = [a for a in args.algos if a not in ALGOS]
  if bad:
    p.error(f"--algos: unknown {bad}; allowed {list(ALGOS)}")
  records = run(args)
  if records:
    print(table(records, args.cell))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
