"""Do block attention residuals help depth? k-hop induction at 4 and 16+ layers, AttnRes on/off.

  python benchmarks/attnres_depth.py                       # defaults below: 4 variants x 3 seeds
  python benchmarks/attnres_depth.py --layers=16 --seeds=0 --steps=600 --out=/tmp/ar.jsonl

The task (k-hop induction heads, Sanford, Hsu and Telgarsky 2024, arXiv:2402.09268; written
here from its definition): a sequence X over an alphabet of A symbols; sigma(i) = 1 + the last
j < i with X_j = X_i (undefined when X_i has not occurred before); the k-hop answer at
position i is X_{sigma^k(i)}. Every position where all k hops exist is scored (a causal
sequence-labelling loss, the answer is a token already seen). One hop is an induction head;
k hops compose k lookups, and the paper proves depth Theta(log k) is what a transformer needs
for them, so it is a task where depth matters. k is drawn per sequence from --hops and shown
to the model as the first token, so one model is measured at every k.

Variants: the decoder of this project (`model.decoder.HybridLM`, layer pattern
`default_layer_kinds`: MLA at every 4th and the last layer, KDA elsewhere; dense FFN, no MoE)
at each of --layers, with `model.attnres.enabled` True (block AttnRes, block_size --block) and
False (plain pre-norm residual), all else equal: the same initial seed per run seed, the same
training stream, the same held-out sequences (a separate seed stream).

Output: one JSON line per (layers, attnres, seed) with accuracy per k, the per-step wall time
and the training loss; then, per depth, the AttnRes - plain delta of the accuracy per k:
mean over seeds with a 95% t-interval over the paired seeds (seed = the unit: it carries
the training variance), and per seed a 95% bootstrap interval over held-out sequences
(paired: both models answer the same sequences). The wall-time ratio of the two variants is
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))
from benchmarks.mqar_arch import (dense_model_dict, make_optimizer, make_predict,  # noqa: E402
                                  make_train_step)
from hybridmoe_jax.config import (ComputeConfig, default_layer_kinds,  # noqa: E402
                                  model_config_from_dict)
from hybridmoe_jax.model.decoder import HybridLM  # noqa: E402
from benchmarks._timing import Stopwatch  # noqa: E402

# Two-sided 95% Student t quantiles by degrees of freedom (seeds - 1).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262}


def khop_batch(rng: np.random.Generator, n: int, seq_len: int, alphabet: int,
               hops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """n k-hop sequences.

  Returns:
    inputs int32 [n, seq_len]: token 0 is alphabet + index of k in `hops`, then X.
    targets int32 [n, seq_len]: X_{sigma^k(i)} at position i of X, -1 where undefined.
    k int [n]: the hop count of each sequence.
  """
  hops = np.asarray(hops)
  k = rng.choice(hops, n)
  t = seq_len - 1
  x = rng.integers(0, alphabet, (n, t))
  rows = np.arange(n)
  last = np.full((n, alphabet), -1)
  sigma = np.full((n, t), -1)
  for i in range(t):                       # sigma(i) = 1 + previous occurrence of X_i
    seen = last[rows, x[:, i]]
    sigma[:, i] = np.where(seen >= 0, seen + 1, -1)
    last[rows, x[:, i]] = i
  idx = np.broadcast_to(np.arange(t), (n, t)).copy()
  for h in range(int(hops.max())):
    nxt = np.where(idx >= 0, np.take_along_axis(sigma, np.maximum(idx, 0), 1), -1)
    idx = np.where((h < k)[:, None], nxt, idx)
  answer = np.where(idx >= 0, np.take_along_axis(x, np.maximum(idx, 0), 1), -1)
  head = (alphabet + np.searchsorted(np.sort(hops), k))[:, None]
  inputs = np.concatenate([head, x], 1).astype(np.int32)
  targets = np.concatenate([np.full((n, 1), -1), answer], 1).astype(np.int32)
  return inputs, targets, k


def khop_reference(x: list[int], k: int) -> list[int]:
  """The definition, one position at a time (for tests): answer per position, -1 undefined."""
  def sigma(i):
    js = [j for j in range(i) if x[j] == x[i]]
    return js[-1] + 1 if js else None

  out = []
  for i in range(len(x)):
    pos = i
    for _ in range(k):
      pos = sigma(pos) if pos is not None else None
    out.append(x[pos] if pos is not None else -1)
  return out


def variant_config(layers: int, attnres: bool, *, alphabet: int, num_hops: int, d_model: int,
                   block: int):
  m = dense_model_dict(default_layer_kinds(layers), vocab=alphabet + num_hops, d_model=d_model)
  m["attnres"].update(enabled=attnres, block_size=block)
  return model_config_from_dict(m)


def t_interval(x) -> tuple[float, float, float]:
  """Mean and 95% Student t interval over the entries of x (nan interval for one entry)."""
  x = np.asarray(x, float)
  mean = float(x.mean())
  if len(x) < 2:
    return mean, float("nan"), float("nan")
  half = _T95.get(len(x) - 1, 1.96) * float(x.std(ddof=1)) / np.sqrt(len(x))
  return mean, mean - half, mean + half


def paired_bootstrap(correct_a: np.ndarray, correct_b: np.ndarray, scored: np.ndarray,
                     rng: np.random.Generator, reps: int = 2000) -> tuple[float, float] | None:
  """95% interval of acc(a) - acc(b), resampling sequences (rows) of the same held-out set
  (None when nothing is scored).

  correct_*, scored: bool [N, T]; accuracy = correct scored positions / scored positions.
  """
  ca = (correct_a & scored).sum(1).astype(float)
  cb = (correct_b & scored).sum(1).astype(float)
  s = scored.sum(1).astype(float)
  if s.sum() == 0:
    return None
  idx = rng.integers(0, len(s), (reps, len(s)))
  n = s[idx].sum(1)
  ok = n > 0                                 # a resample may hold no scored position
  d = (ca[idx].sum(1)[ok] - cb[idx].sum(1)[ok]) / n[ok]
  lo, hi = np.quantile(d, [0.025, 0.975])
  return float(lo), float(hi)


def run_variant(layers: int, attnres: bool, seed: int, args, held_out) -> tuple[dict, np.ndarray]:
  """Train one model; returns its JSON row and its argmax answers on the held-out set."""
  hops = np.asarray(args.hops)
  cfg = variant_config(layers, attnres, alphabet=args.alphabet, num_hops=len(hops),
                       d_model=args.d_model, block=args.block)
  model = HybridLM(cfg, rngs=nnx.Rngs(seed), compute=ComputeConfig(kda_impl="chunked"))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = make_optimizer(args.lr, args.steps)
  opt_state = tx.init(params)
  step = make_train_step(graphdef, tx)
  rng = np.random.default_rng(seed)          # the same training stream for every variant
  losses = []
  sw = Stopwatch()
  steady = None
  for i in range(args.steps):
    if i == 1:
      jax.block_until_ready(params)
      steady = Stopwatch()                   # per-step time without the first step's compile
    x, y, _ = khop_batch(rng, args.batch, args.seq_len, args.alphabet, hops)
    params, opt_state, loss, _ = step(params, opt_state, rest, jnp.asarray(x), jnp.asarray(y))
    losses.append(float(loss))
    if args.log_every and (i + 1) % args.log_every == 0:
      print(f"  [L{layers} attnres={int(attnres)} s{seed}] step {i + 1:5d}  "
            f"loss {np.mean(losses[-args.log_every:]):.3f}  {sw.seconds:6.1f}s", flush=True)
  step_s = steady.seconds / max(1, args.steps - 1) if steady else float("nan")
  x, y, k = held_out
  predict = make_predict(graphdef)
  pred = np.concatenate([np.asarray(predict(params, rest, jnp.asarray(x[i:i + 256])))
                         for i in range(0, len(x), 256)])
  acc = {}
  for kk in hops:
    sel = (k == kk)[:, None] & (y >= 0)
    acc[str(int(kk))] = float((pred == y)[sel].mean())
  row = {"layers": layers, "attnres": attnres, "seed": seed, "accuracy": acc,
         "mean_accuracy": float(np.mean(list(acc.values()))),
         "final_train_loss": float(np.mean(losses[-50:])), "step_s": round(step_s, 4),
         "wall_s": round(sw.seconds, 1), "steps": args.steps, "batch": args.batch,
         "seq_len": args.seq_len, "alphabet": args.alphabet, "hops": [int(h) for h in hops],
         "d_model": args.d_model, "block": args.block, "lr": args.lr,
         "params": int(sum(v.size for v in jax.tree.leaves(params)))}
  return row, pred


def deltas(rows: list[dict], preds: dict, held_out, args) -> list[dict]:
  """Per depth: AttnRes - plain accuracy per k, over seeds (t) and per seed (bootstrap).

  rows / preds hold every (layers, attnres, seed) of args, keyed like preds."""
  _, y, k = held_out
  rng = np.random.default_rng(12345)
  by = {(r["layers"], r["attnres"], r["seed"]): r for r in rows}
  out = []
  for layers in args.layers:
    for kk in [str(int(h)) for h in args.hops] + ["mean"]:
      acc = lambda r: r["mean_accuracy"] if kk == "mean" else r["accuracy"][kk]
      per_seed = [acc(by[layers, True, s]) - acc(by[layers, False, s]) for s in args.seeds]
      boots = [] if kk == "mean" else [
          paired_bootstrap(preds[layers, True, s] == y, preds[layers, False, s] == y,
                           (k == int(kk))[:, None] & (y >= 0), rng) for s in args.seeds]
      mean, lo, hi = t_interval(per_seed)
      out.append({"layers": layers, "k": kk, "delta_mean": mean, "delta_t95": [lo, hi],
                  "delta_per_seed": per_seed, "per_seed_bootstrap95": boots,
                  "seeds": len(per_seed)})
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ints = lambda s: [int(v) for v in s.split(",") if v]
  ap.add_argument("--layers", type=ints, default=[4, 16])
  ap.add_argument("--seeds", type=ints, default=[0, 1, 2])
  ap.add_argument("--hops", type=ints, default=[1, 2, 4, 8])
  ap.add_argument("--alphabet", type=int, default=4)
  ap.add_argument("--seq_len", type=int, default=64)
  ap.add_argument("--steps", type=int, default=600)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--d_model", type=int, default=64)
  ap.add_argument("--block", type=int, default=2, help="model.attnres.block_size")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--eval_samples", type=int, default=1024)
  ap.add_argument("--log_every", type=int, default=100)
  ap.add_argument("--out", default=None, help="append the JSON lines here")
  args = ap.parse_args(argv)
  for name, lo in (("layers", 1), ("hops", 1), ("seeds", 0)):
    vals = getattr(args, name)
    if not vals or min(vals) < lo:
      ap.error(f"--{name}: need a non-empty list of integers >= {lo}, got {vals}")
  for name, lo in (("alphabet", 2), ("seq_len", 4), ("steps", 1), ("batch", 1),
                   ("d_model", 8), ("block", 1), ("eval_samples", 1)):
    if getattr(args, name) < lo:
      ap.error(f"--{name}: need >= {lo}, got {getattr(args, name)}")

  held_out = khop_batch(np.random.default_rng(10_000), args.eval_samples, args.seq_len,
                        args.alphabet, np.asarray(args.hops))
  rows, preds = [], {}
  for seed in args.seeds:
    for layers in args.layers:
      for attnres in (True, False):
        row, pred = run_variant(layers, attnres, seed, args, held_out)
        rows.append(row)
        preds[(layers, attnres, seed)] = pred
        print(json.dumps(row), flush=True)
        if args.out:
          with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
  summary = deltas(rows, preds, held_out, args)
  for s in summary:
    print(json.dumps({"delta": s}), flush=True)
  if args.out:
    with open(args.out, "a") as f:
      for s in summary:
        f.write(json.dumps({"delta": s}) + "\n")

  print(f"\nk-hop accuracy on {args.eval_samples} held-out sequences (alphabet {args.alphabet}, "
        f"T {args.seq_len}, {args.steps} steps x {args.batch}); mean over seeds {args.seeds}")
  print("layers attnres " + "".join(f"  k={h:<5d}" for h in args.hops) + "  step_s")
  for layers in args.layers:
    for attnres in (True, False):
      rs = [r for r in rows if r["layers"] == layers and r["attnres"] == attnres]
      print(f"{layers:6d} {str(attnres):7s} "
            + "".join(f"  {np.mean([r['accuracy'][str(h)] for r in rs]):.3f}  " for h in args.hops)
            + f"  {np.mean([r['step_s'] for r in rs]):.3f}")
  print("\nAttnRes - plain (mean over seeds [95% t-interval over seeds])")
  for s in summary:
    print(f"  L{s['layers']:<3d} k={s['k']:<5s} {s['delta_mean']:+.3f} "
          f"[{s['delta_t95'][0]:+.3f}, {s['delta_t95'][1]:+.3f}]  per seed "
          + ", ".join(f"{d:+.3f}" for d in s["delta_per_seed"]))
  return rows, summary


if __name__ == "__main__":
  main()
