"""The RULER-style suite (`hybridmoe_jax.evals.ruler`) on several models in one run, the first
the reference: per task x length cell the score, the 95% Wilson interval of the all-correct
rate, and the score's difference from the reference's on the same prompts (same fixed seed).

  python benchmarks/ruler.py --models=v3=runs/lcr_v3_s0,text=runs/lc50_text1_s0 \
      --lengths=8192,32768,65536 --tasks=niah_single --samples=100 --seed=0
  python benchmarks/ruler.py --models=v3=runs/a,text=runs/b --split=validation   # choose here

A model is a training run directory (its newest checkpoint) or a params export (a converted
Hugging Face checkpoint is one), with its own tokenizer. The seed is fixed (default 0) so every
model answers the same prompts; --split=validation is the split to compare recipes on, "test"
(default) the one to report. Prints one JSON line per model and a table; appends the whole
result to --results (a JSON list; earlier entries are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

# pylint: disable=wrong-import-position
from hybridmoe_jax.data.tokenizers.load import TOKENIZER_DIR, tokenizer_from_dir
from hybridmoe_jax.evals import ruler
from hybridmoe_jax.loading import load_model
from hybridmoe_jax.infer import Engine
from benchmarks._timing import stopwatch

RESULTS = _ROOT / "benchmarks" / "results" / "ruler.json"


def _models(spec: str) -> list[tuple[str, str]]:
  out = []
  for part in (p for p in spec.split(",") if p):
    label, sep, path = part.partition("=")
    if not sep or not label or not path:
      raise SystemExit(f"error: --models: {part!r} is not label=path")
    if not os.path.isdir(path):
      raise SystemExit(f"error: --models: {path} is not a directory")
    out.append((label, path))
  if not out:
    raise SystemExit("error: --models is empty")
  return out


def evaluate(path: str, args) -> dict:
  is_run = os.path.isdir(os.path.join(path, "checkpoints"))
  model, info = load_model(workdir=path if is_run else None, params=None if is_run else path)
  tok = tokenizer_from_dir(os.path.join(path, TOKENIZER_DIR))
  cap = 1 << (max(args.lengths) + 255).bit_length()
  engine = Engine(model, max_len=cap, prefill_chunk=args.prefill_chunk,
                  kv_block=args.kv_block)
  with stopwatch() as sw:
    r = ruler.evaluate_ruler(engine, args.tasks, args.lengths, samples=args.samples,
                             seed=args.seed, split=args.split, batch=args.batch,
                             tokenizer=tok)
  r["wall_s"] = sw.seconds
  r["step"] = info.get("step")
  return r


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", required=True, help="label=path[,label=path...]; first = reference")
  p.add_argument("--tasks", default=",".join(ruler.TASKS))
  p.add_argument("--lengths", default="8192,32768,65536")
  p.add_argument("--samples", type=int, default=100)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--split", default="test", choices=("validation", "test"))
  p.add_argument("--batch", type=int, default=10)
  p.add_argument("--prefill_chunk", type=int, default=1024)
  p.add_argument("--kv_block", type=int, default=1024)
  p.add_argument("--results", default=str(RESULTS))
  p.add_argument("--machine", default="2-core CPU box (shared)",
                 help="recorded with the figures")
  args = p.parse_args(argv)
  args.tasks = tuple(t for t in args.tasks.split(",") if t)
  try:
    args.lengths = tuple(int(x) for x in args.lengths.split(",") if x)
    ruler.check_options(args.tasks, args.lengths, args.samples, args.batch, args.split)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  models = _models(args.models)
  results = {}
  for label, path in models:
    results[label] = r = evaluate(path, args)
    print(json.dumps({"model": label, "path": path, "step": r["step"], "split": r["split"],
                      "seed": r["seed"], "samples": r["samples"], "wall_s": round(r["wall_s"], 1),
                      "machine": args.machine, "score": r["score"],
                      "wilson_low": r["wilson_low"], "wilson_high": r["wilson_high"]}))
    print(ruler.format_table(r))
  ref_label = models[0][0]
  ref = results[ref_label]
  for label, r in list(results.items())[1:]:
    print(f"{label} - {ref_label} (score difference, same prompts):")
    for i, t in enumerate(args.tasks):
      print(f"  {t:<20}" + "".join(f"{r['score'][i][j] - ref['score'][i][j]:>+9.2f}"
                                   for j in range(len(args.lengths))))
  out = pathlib.Path(args.results)
  old = json.loads(out.read_text()) if out.is_file() else []
  old.append({"models": dict(models), "machine": args.machine, "tasks": list(args.tasks),
              "lengths": list(args.lengths), "results": results})
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(".tmp")
  tmp.write_text(json.dumps(old, indent=1))
  os.replace(tmp, out)


if __name__ == "__main__":
  main()
