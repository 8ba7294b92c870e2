"""Long-context retrieval: the curriculum of configs/long_context_cpu.py per variant and seed,
NIAH after every stage, key-value recall by number of pairs; results recorded, figures drawn.

  # train (skips runs already finished), evaluate, record, draw:
  python benchmarks/long_context_retrieval.py --variants=hybrid,hybrid_rope,kda,mla --seeds=0 \
      --stages=3 --root=runs/lcr
  # figures and table only, from the recorded results:
  python benchmarks/long_context_retrieval.py --plot_only

Each run is `run_train.py --config=configs/long_context_cpu.py:<variant>,stages=<n>,seed=<s>`
(nice 19) into <root>/<variant>_n<n>_s<s>; its NIAH grids are the run's own
eval/niah_stage<k>.json (held-out keys and hay, `evals.niah`). After training, key-value recall
in the training format (`evaluate_kv_recall` below, held-out keys) at the last stage's
length (at most 2K) for 2..32 pairs. Everything goes to --results (JSON; a run already recorded
there is replaced, others are kept) and one JSON line per run on stdout; the figures in
docs/images/ are drawn from that file only:
  niah_stage<k>.png         the hybrid's grid after stage k (seed 0); niah_heatmap.png the last
  long_context_extrapolation.png   exact match vs prompt length per variant after the last
                            stage (mean over seeds, min-max band), trained length marked
  kv_recall_pairs.png       key-value recall vs pairs per variant
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Sequence

import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

from hybridmoe_jax import plots  # pylint: disable=wrong-import-position
from hybridmoe_jax.data import retrieval  # pylint: disable=wrong-import-position
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer  # pylint: disable=wrong-import-position
from benchmarks._timing import stopwatch  # pylint: disable=wrong-import-position

RESULTS = _ROOT / "benchmarks" / "results" / "long_context_retrieval.json"
IMAGES = _ROOT / "docs" / "images"
KV_PAIRS = (2, 4, 8, 16, 32)


def _options(steps: int = 0, weight: int = 0, factor: int = 0, lr: float = 0,
             late_lr: float = 0, late_scale: int = 0) -> str:
  """The config string's optional fields (0: the recipe's value)."""
  return "".join(f",{k}={v}" for k, v in (("steps", steps), ("weight", weight),
                                          ("factor", factor), ("lr", lr),
                                          ("late_lr", late_lr),
                                          ("late_scale", late_scale)) if v)


def run_name(variant: str, stages: int, seed: int, steps: int = 0, weight: int = 0,
             factor: int = 0, lr: float = 0, late_lr: float = 0, late_scale: int = 0) -> str:
  return (f"{variant}_n{stages}{f'_t{steps}' if steps else ''}{f'_w{weight}' if weight else ''}"
          f"{f'_f{factor}' if factor else ''}{f'_lr{lr:g}' if lr else ''}"
          f"{f'_llr{late_lr:g}' if late_lr else ''}"
          f"{f'_ls{late_scale}' if late_scale and stages > 1 else ''}_s{seed}")


def train(variant: str, stages: int, seed: int, workdir: str, steps: int = 0, weight: int = 0,
          factor: int = 0, lr: float = 0, late_lr: float = 0, late_scale: int = 0,
          nice: int = 19) -> float:
  """Runs the recipe unless its last stage's NIAH grid exists; -> wall seconds (0 if done)."""
  if os.path.exists(os.path.join(workdir, "eval", f"niah_stage{stages - 1}.json")):
    return 0.0
  cmd = ["nice", "-n", str(nice), sys.executable, str(_ROOT / "run_train.py"),
         f"--config={_ROOT / 'configs' / 'long_context_cpu.py'}:{variant},stages={stages},"
         f"seed={seed}{_options(steps, weight, factor, lr, late_lr, late_scale)}",
         f"--workdir={workdir}"]
  with open(workdir + ".log", "a", encoding="utf-8") as log, stopwatch() as sw:
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
  return sw.seconds


def kv_recall_example(rng: np.random.Generator, length: int, pairs: int,
                      tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """One held-out key-value recall document in the training format
  (`data.retrieval.kv_pieces`: " k3f9a=71;" pairs in filler, then " Recall: k0b2c=05; ...";
  evaluation keys and seed stream) of ~`length` tokens: (tokens int32 [n] starting with BOS,
  answer mask bool [n]: the value tokens of the recall part). Each piece is tokenized alone,
  so answers stay whole tokens: multi-query associative recall (`evals.mqar`) in the text
  format a language model is trained on."""
  pieces = retrieval.kv_pieces(rng, length - 1, "eval", pairs)
  toks, mask = [np.asarray([tokenizer.bos_id], np.int32)], [np.zeros(1, bool)]
  for text, is_answer in pieces:
    ids = np.asarray(tokenizer.encode(text), np.int32)
    toks.append(ids)
    mask.append(np.full(len(ids), is_answer))
  return np.concatenate(toks), np.concatenate(mask)


def evaluate_kv_recall(engine, lengths: Sequence[int], pairs: Sequence[int], *,
                       samples: int = 8, seed: int = 0, tokenizer=None) -> dict:
  """Text MQAR on an `infer.Engine`: recall of every value (all its tokens right,
  teacher-forced greedy) per (length, pairs) cell on held-out documents; chance = 1/100
  (2-digit values).

  Raises:
    ValueError: a document longer than the engine's max_len, or no pairs that fit a length
      (each pair costs ~20 bytes).
  """
  tok = tokenizer or ByteTokenizer()
  rng = retrieval.rng_for("eval", seed, 1)
  cells = []
  for t in lengths:
    for n in pairs:
      if 22 * n + 16 > t:
        continue
      rows = [kv_recall_example(rng, t, n, tok) for _ in range(samples)]
      right = []
      for toks, mask in rows:
        if len(toks) > engine.max_len:
          raise ValueError(f"kv recall document of {len(toks)} tokens exceeds max_len="
                           f"{engine.max_len}")
        _, pred = engine.score(toks[None])
        hit = pred[0] == toks[1:]                 # pred[i] predicts token i + 1
        ans = mask[1:]
        # Group consecutive answer tokens into values: a value is right if all its are.
        starts = np.flatnonzero(ans & ~np.concatenate([[False], ans[:-1]]))
        ends = np.flatnonzero(ans & ~np.concatenate([ans[1:], [False]])) + 1
        right += [bool(hit[s:e].all()) for s, e in zip(starts, ends)]
      cells.append({"length": t, "pairs": n, "accuracy": float(np.mean(right)),
                    "queries": len(right)})
  if not cells:
    raise ValueError(f"kv recall: no (length, pairs) cell fits: lengths {list(lengths)}, "
                     f"pairs {list(pairs)} (need length >= 22 * pairs + 16)")
  return {"cells": cells, "chance": 0.01, "samples": samples,
          "mean_accuracy": float(np.mean([c["accuracy"] for c in cells]))}


def kv_recall(workdir: str, max_len: int) -> dict:
  """Key-value recall of the run's final model (eval/kv_recall.json, computed once)."""
  path = os.path.join(workdir, "eval", "kv_recall.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  from hybridmoe_jax.data.tokenizers.load import TOKENIZER_DIR, tokenizer_from_dir  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.loading import load_model  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.infer import Engine  # pylint: disable=g-import-not-at-top
  model, _ = load_model(workdir=workdir)
  tok = tokenizer_from_dir(os.path.join(workdir, TOKENIZER_DIR))
  engine = Engine(model, max_len=max_len + 8, prefill_chunk=1024, kv_block=1024)
  result = evaluate_kv_recall(engine, [max_len], KV_PAIRS, samples=4, tokenizer=tok)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  return result


def collect(variant: str, stages: int, seed: int, workdir: str, seconds: float,
            steps: int = 0, weight: int = 0, factor: int = 0, lr: float = 0,
            late_lr: float = 0, late_scale: int = 0) -> dict:
  grids = []
  for k in range(stages):
    with open(os.path.join(workdir, "eval", f"niah_stage{k}.json"), encoding="utf-8") as f:
      g = json.load(f)
    grids.append({key: g[key] for key in (
        "stage", "stage_seq_len", "step", "lengths", "depths", "samples", "accuracy",
        "digit_accuracy", "key_nll_gain", "chance")})
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    train_rows = [r for r in map(json.loads, f) if r.get("split") == "train"]
  last = grids[-1]["stage_seq_len"]
  return {"run": run_name(variant, stages, seed, steps, weight, factor, lr, late_lr, late_scale),
          "variant": variant, "seed": seed, "first_stage_lr": lr or None,
          "late_stage_lr": late_lr or None, "late_stage_scale": late_scale or None,
          "stages": stages, "first_stage_steps": steps or None, "answer_weight": weight or None,
          "niah": grids, "kv_recall": kv_recall(workdir, min(last, 2048)),
          "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
          "train_wall_s": round(seconds, 1)}


def per_length(grid: dict) -> dict[int, float]:
  """{prompt length: exact match averaged over depths}."""
  acc = np.asarray(grid["accuracy"])
  return {int(n): float(acc[:, j].mean()) for j, n in enumerate(grid["lengths"])}


# --------------------------------------------------------------------------- figures
ORDER = ["hybrid", "hybrid_rope", "kda", "mla"]


def extrapolation_figure(runs: list[dict]):
  """Left: exact match vs prompt length after the first (512) stage, per variant (mean over
  seeds, min-max band). Right: the full recipe's runs after each stage."""
  full = [r for r in runs if r["stages"] > 1]
  fig = plots.new_figure(12.0 if full else 7.0, 4.5)
  left = fig.add_subplot(1, 2 if full else 1, 1)
  first = [r for r in runs if r["stages"] == 1]
  for v in sorted({r["variant"] for r in first}, key=ORDER.index):
    curves = [per_length(r["niah"][0]) for r in first if r["variant"] == v]
    lengths = sorted(set.intersection(*(set(c) for c in curves)))
    ys = np.array([[c[n] for n in lengths] for c in curves])
    color = f"C{ORDER.index(v)}"
    left.plot(lengths, ys.mean(0), "o-", color=color,
              label=f"{v} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
    if len(curves) > 1:
      left.fill_between(lengths, ys.min(0), ys.max(0), color=color, alpha=0.2)
    digits = [per_length(dict(r["niah"][0], accuracy=r["niah"][0]["digit_accuracy"]))
              for r in first if r["variant"] == v]
    left.plot(lengths, np.mean([[d[n] for n in lengths] for d in digits], 0), "x--",
              color=color, label=f"{v}: per-digit accuracy (chance 0.1)")
  left.set_title("after the 512-token stage, by variant", fontsize=10)
  axes = [left]
  if full:
    right = fig.add_subplot(1, 2, 2)
    right.set_title("full recipe 512 -> 2K -> 8K, after each stage", fontsize=10)
    axes.append(right)
  for r in full:
    for g in r["niah"]:
      pl = per_length(g)
      right.plot(sorted(pl), [pl[n] for n in sorted(pl)], "o-", color=f"C{g['stage']}",
                 label=f"{r['variant']} s{r['seed']} after stage {g['stage']} "
                       f"(trained {g['stage_seq_len']})")
      right.axvline(g["stage_seq_len"], color=f"C{g['stage']}", ls="--", lw=0.8)
  for ax in axes:
    ax.axhline(1e-5, color="gray", ls=":", lw=1, label="chance (1e-5)")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.08)
    ax.set_xlabel("prompt length (tokens)")
    ax.legend(fontsize=7, loc="lower left")
  left.axvline(512, color="gray", ls="--", lw=0.8)
  left.set_ylabel("passkey accuracy (mean over depths)")
  fig.suptitle("NIAH on held-out keys and hay (2-core CPU runs)", fontsize=11)
  return fig


def kv_figure(runs: list[dict]):
  fig = plots.new_figure(6.5, 4.0)
  ax = fig.add_subplot()
  variants = sorted({r["variant"] for r in runs})
  for i, v in enumerate(variants):
    cells = [r["kv_recall"]["cells"] for r in runs if r["variant"] == v]
    pairs = [c["pairs"] for c in cells[0]]
    ys = np.array([[c["accuracy"] for c in cs] for cs in cells])
    ax.plot(pairs, ys.mean(0), "o-", label=f"{v} ({len(cells)} seed(s))")
  ax.axhline(0.01, color="C3", ls=":", lw=1, label="chance (1/100)")
  ax.set_xscale("log", base=2)
  ax.set_ylim(-0.03, 1.05)
  ax.set_xlabel("key-value pairs in the document")
  ax.set_ylabel("values recalled (held-out keys)")
  ax.set_title(f"Key-value recall at {runs[0]['kv_recall']['cells'][0]['length']} tokens")
  ax.legend(fontsize=8)
  return fig


def draw(results: dict, out_dir: pathlib.Path) -> list[str]:
  runs = results["runs"]
  if not runs:
    return []
  out_dir.mkdir(parents=True, exist_ok=True)
  out = []
  # The latest recorded hybrid run among those with the most stages (sorted() is stable).
  hybrids = sorted((r for r in reversed(runs) if r["variant"] == "hybrid"),
                   key=lambda r: (-r["stages"], r["seed"]))
  show = hybrids[0] if hybrids else runs[0]
  for grid in show["niah"]:
    fig = plots.niah_figure(dict(grid, mean_accuracy=float(np.mean(grid["accuracy"]))))
    fig.axes[0].set_title(f"{show['variant']}: NIAH after stage {grid['stage']} (trained "
                          f"{grid['stage_seq_len']}, step {grid['step']}; {grid['samples']} "
                          "held-out prompts/cell)", fontsize=9)
    out.append(plots.save(fig, str(out_dir / f"niah_stage{grid['stage']}.png")))
  out.append(plots.save(fig, str(out_dir / "niah_heatmap.png")))
  out.append(plots.save(extrapolation_figure(runs),
                        str(out_dir / "long_context_extrapolation.png")))
  out.append(plots.save(kv_figure([r for r in runs if r["stages"] == 1] or runs),
                        str(out_dir / "kv_recall_pairs.png")))
  return out


def table(results: dict) -> str:
  """Markdown rows: per run and stage, exact match at the trained length, 2x ... 32x."""
  factors = (1, 2, 4, 8, 16, 32)
  lines = ["| run | variant | seed | stage (trained) | step | "
           + " | ".join(f"@{f}x" for f in factors) + " | digit acc @1x |",
           "| --- " * (len(factors) + 6) + "|"]
  for r in sorted(results["runs"], key=lambda r: (r["stages"], ORDER.index(r["variant"]),
                                                  r["seed"])):
    for g in r["niah"]:
      pl, t = per_length(g), g["stage_seq_len"]
      dig = np.asarray(g["digit_accuracy"])
      d1 = float(dig[:, g["lengths"].index(t)].mean()) if t in g["lengths"] else float("nan")
      cells = [f"{pl[f * t]:.2f}" if f * t in pl else "-" for f in factors]
      lines.append(f"| {r['run']} | {r['variant']} | {r['seed']} | {g['stage']} ({t}) | {g['step']} | "
                   + " | ".join(cells) + f" | {d1:.2f} |")
  return "\n".join(lines)


def summary(results: dict) -> str:
  """Markdown rows: per recipe (the run name without its seed: variant and options), the
  single-stage (512) runs' exact match by prompt length over their seeds (mean, min-max); a
  full recipe's first stage (the same training) is a row of its own, "(stage 0)"."""
  first = results["runs"]
  recipe = lambda r: r["run"].rsplit("_s", 1)[0] + (" (stage 0)" if r["stages"] > 1 else "")
  names = sorted({recipe(r) for r in first}, key=lambda n: (ORDER.index(n.split("_n")[0]), n))
  every = sorted({n for r in first for n in per_length(r["niah"][0])})
  out = ["| recipe (seeds) | " + " | ".join(str(n) for n in every) + " |",
         "| --- " * (len(every) + 1) + "|"]
  for name in names:
    curves = [per_length(r["niah"][0]) for r in first if recipe(r) == name]
    cells = []
    for n in every:
      ys = [c[n] for c in curves if n in c]
      cells.append("-" if not ys else f"{ys[0]:.2f}" if len(ys) == 1
                   else f"{np.mean(ys):.2f} ({min(ys):.2f}-{max(ys):.2f})")
    out.append(f"| {name} ({len(curves)}) | " + " | ".join(cells) + " |")
  return "\n".join(out)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--variants", default="hybrid")
  ap.add_argument("--seeds", default="0")
  ap.add_argument("--stages", type=int, default=3)
  ap.add_argument("--steps", type=int, default=0, help="first stage's steps (0: the recipe's)")
  ap.add_argument("--weight", type=int, default=0,
                  help="retrieval answer loss weight of every stage (0: the recipe's)")
  ap.add_argument("--factor", type=int, default=0,
                  help="NIAH up to factor x each stage's length (0: the recipe's, 8)")
  ap.add_argument("--lr", type=float, default=0,
                  help="first stage's peak learning rate (0: the recipe's, 1.5e-3)")
  ap.add_argument("--late_lr", type=float, default=0,
                  help="peak learning rate of the later stages (0: the recipe's)")
  ap.add_argument("--late_scale", type=int, default=6,
                  help="the later stages' steps times this (the recipe's 6; 1: recipe v2)")
  ap.add_argument("--nice", type=int, default=19, help="niceness of the training runs")
  ap.add_argument("--root", default="runs/lcr")
  ap.add_argument("--results", default=str(RESULTS))
  ap.add_argument("--images", default=str(IMAGES))
  ap.add_argument("--plot_only", action="store_true")
  ap.add_argument("--figures_from", default="",
                  help="draw the figures and the summary from the runs whose name this regex "
                       "matches (re.search; e.g. 'lr0.0015_(ls6_)?s': one recipe's runs); the "
                       "table lists every run")
  args = ap.parse_args()
  results = {"runs": []}
  if os.path.exists(args.results):
    with open(args.results, encoding="utf-8") as f:
      results = json.load(f)
  if not args.plot_only:
    os.makedirs(args.root, exist_ok=True)
    for v in args.variants.split(","):
      for s in (int(x) for x in args.seeds.split(",")):
        opts = (args.steps, args.weight, args.factor, args.lr, args.late_lr, args.late_scale)
        workdir = os.path.join(args.root, run_name(v, args.stages, s, *opts))
        seconds = train(v, args.stages, s, workdir, *opts, nice=args.nice)
        row = collect(v, args.stages, s, workdir, seconds, *opts)
        if os.path.exists(args.results):  # runs recorded meanwhile by a parallel invocation
          with open(args.results, encoding="utf-8") as f:
            results["runs"] = json.load(f)["runs"]
        results["runs"] = [r for r in results["runs"] if r["run"] != row["run"]] + [row]
        print(json.dumps({k: row[k] for k in ("run", "final_train_loss", "train_wall_s")} |
                         {"niah_by_length": per_length(row["niah"][-1]),
                          "kv_recall": [c["accuracy"] for c in row["kv_recall"]["cells"]]}),
              flush=True)
        results["machine"] = (f"2-core CPU box shared with other jobs, runs at nice "
                              f"{args.nice}")
        os.makedirs(os.path.dirname(args.results), exist_ok=True)
        with open(args.results, "w", encoding="utf-8") as f:
          json.dump(results, f, indent=1)
  picked = dict(results, runs=[r for r in results["runs"]
                                   if re.search(args.figures_from, r["run"])])
  for path in draw(picked, pathlib.Path(args.images)):
    print(f"figure {path}")
  print(table(results))
  print(summary(picked))


if __name__ == "__main__":
  main()
