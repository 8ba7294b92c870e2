"""MQAR recall by architecture: KDA-only, MLA-only, hybrid 3:1 and KDA with the unbounded gate.

  python benchmarks/mqar_arch.py                                  # defaults below
  python benchmarks/mqar_arch.py --steps=800 --batch=32 --lengths=64,128,256 --pairs=4,8,16 \
      --archs=kda,mla,hybrid,kda_unbounded --out=/tmp/mqar_arch.jsonl

Every architecture is the same small 4-layer model (d_model 64, dense FFN in every layer so
no MoE routing noise, attention residuals as in configs/tiny.py) trained from scratch with
the same seed, steps, batch and learning-rate schedule on multi-query associative recall
(`hybridmoe_jax.evals.mqar.make_mqar`). Each training step draws one (length, pairs) cell of
the grid at random; the loss is cross-entropy on the answer positions only (the token after
each query). Accuracy is then measured per cell on held-out sequences drawn from a separate
seed. Output: one JSON line per (arch, length, pairs) (also appended to --out), a table, and
the wall time (training + compile + evaluation) per architecture.

Architectures (4 layers each):
  kda            K K K K, bounded gate
  mla            M M M M
  hybrid         K K K M (the tiny default pattern, 3:1)
  kda_unbounded  K K K K, unbounded gate (-exp(A) * softplus(.))
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))
from hybridmoe_jax.config import ComputeConfig, ModelConfig, model_config_from_dict
from hybridmoe_jax.evals.mqar import accuracy, make_mqar, token_ranges
from hybridmoe_jax.model.decoder import HybridLM
from hybridmoe_jax.config.flags import load_config_file
from benchmarks._timing import Stopwatch

# arch: (layer kinds, KDA gate, MLA rope_theta; 0: no positions, NoPE)
ARCHS = {
    "kda": (("kda",) * 4, "bounded", 0.0),
    "mla": (("mla",) * 4, "bounded", 0.0),
    "hybrid": (("kda", "kda", "kda", "mla"), "bounded", 0.0),
    "hybrid_rope": (("kda", "kda", "kda", "mla"), "bounded", 10000.0),
    "kda_unbounded": (("kda",) * 4, "unbounded", 0.0),
}


def dense_model_dict(kinds, *, vocab: int, d_model: int) -> dict:
  """configs/tiny.py's model section with these layer kinds and widths and a dense FFN in
  every layer (no MoE routing noise; so no latent MoE projection either)."""
  m = load_config_file(_ROOT / "configs" / "tiny.py").model.to_dict()
  m.update(vocab_size=vocab, d_model=d_model, num_layers=len(kinds), layer_kinds=list(kinds))
  m["moe"].update(first_dense_layers=len(kinds), dense_intermediate=2 * d_model, latent_dim=0)
  return m


def arch_config(arch: str, *, vocab: int, d_model: int = 64) -> ModelConfig:
  kinds, gate, rope_theta = ARCHS[arch]
  m = dense_model_dict(kinds, vocab=vocab, d_model=d_model)
  m["kda"]["gate"] = gate
  m["mla"]["rope_theta"] = rope_theta
  return model_config_from_dict(m)


def make_optimizer(lr: float, steps: int):
  """AdamW (0.9, 0.98, wd 0.1), clipped at norm 1, warmup over 5% then cosine to 5% of lr."""
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps, lr * 0.05)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=0.1))


def make_train_step(graphdef, tx):
  def loss_fn(params, rest, inputs, targets):
    model = nnx.merge(graphdef, params, rest)
    logits, _ = model(inputs)
    mask = targets >= 0
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], -1)[..., 0]
    nll = jnp.where(mask, logz - picked, 0.0)
    loss = jnp.sum(nll) / jnp.maximum(jnp.sum(mask), 1)
    acc = jnp.sum((jnp.argmax(logits, -1) == targets) & mask) / jnp.maximum(jnp.sum(mask), 1)
    return loss, acc

  @jax.jit
  def step(params, opt_state, rest, inputs, targets):
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, inputs,
                                                                   targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, acc

  return step


def make_predict(graphdef):
  @jax.jit
  def predict(params, rest, inputs):
    logits, _ = nnx.merge(graphdef, params, rest)(inputs)
    return jnp.argmax(logits, -1)

  return predict


def cells(lengths, pairs):
  return [(t, p) for t in lengths for p in pairs if 4 * p <= t]


def run_arch(arch: str, args) -> tuple[list[dict], float, list[float]]:
  sw = Stopwatch()
  cfg = arch_config(arch, vocab=args.vocab, d_model=args.d_model)
  model = HybridLM(cfg, rngs=nnx.Rngs(args.seed), compute=ComputeConfig(kda_impl=args.kda_impl))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = make_optimizer(args.lr, args.steps)
  opt_state = tx.init(params)
  step = make_train_step(graphdef, tx)
  grid = cells(args.lengths, args.pairs)
  rng = np.random.default_rng(args.seed)          # same training data for every arch
  losses, accs = [], []
  for i in range(args.steps):
    t, p = grid[rng.integers(len(grid))]
    b = make_mqar(rng, args.batch, t, p, vocab=args.vocab)
    params, opt_state, loss, acc = step(params, opt_state, rest, jnp.asarray(b.inputs),
                                        jnp.asarray(b.targets))
    losses.append(float(loss))
    accs.append(float(acc))
    if args.log_every and (i + 1) % args.log_every == 0:
      print(f"  [{arch}] step {i + 1:5d}  loss {np.mean(losses[-args.log_every:]):.3f}  "
            f"train acc {np.mean(accs[-args.log_every:]):.3f}  "
            f"{sw.seconds:6.1f}s", flush=True)
  train_s = sw.seconds
  predict = make_predict(graphdef)
  eval_rng = np.random.default_rng(10_000 + args.seed)   # held out: a different stream
  rows = []
  for t, p in grid:
    b = make_mqar(eval_rng, args.eval_samples, t, p, vocab=args.vocab)
    pred = np.asarray(predict(params, rest, jnp.asarray(b.inputs)))
    rows.append({"arch": arch, "length": t, "pairs": p,
                 "accuracy": accuracy(pred, b.targets),
                 "queries": int(args.eval_samples * p)})
  wall = sw.seconds
  for r in rows:
    r.update(steps=args.steps, batch=args.batch, seed=args.seed, train_s=round(train_s, 1),
             wall_s=round(wall, 1), final_train_loss=float(np.mean(losses[-50:])))
  return rows, wall, losses


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ints = lambda s: [int(x) for x in s.split(",") if x]
  ap.add_argument("--steps", type=int, default=800)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--lengths", type=ints, default=[64, 128, 256])
  ap.add_argument("--pairs", type=ints, default=[4, 8, 16])
  ap.add_argument("--archs", type=lambda s: [a for a in s.split(",") if a],
                  default=list(ARCHS))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=None, help="append one JSON line per cell here")
  ap.add_argument("--vocab", type=int, default=96, help="MQAR vocab (keys|values|noise)")
  ap.add_argument("--d_model", type=int, default=64)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--kda_impl", default="chunked", choices=["recurrent", "chunked", "auto"])
  ap.add_argument("--eval_samples", type=int, default=64)
  ap.add_argument("--log_every", type=int, default=100)
  args = ap.parse_args(argv)
  unknown = [a for a in args.archs if a not in ARCHS]
  if unknown:
    ap.error(f"unknown arch(s) {unknown}; allowed {list(ARCHS)}")
  if not cells(args.lengths, args.pairs):
    ap.error("no (length, pairs) cell fits (need length >= 4 * pairs)")
  chance = 1.0 / len(token_ranges(args.vocab)[1])

  all_rows, walls = [], {}
  for arch in args.archs:
    print(f"== {arch}: {ARCHS[arch]}", flush=True)
    rows, wall, _ = run_arch(arch, args)
    walls[arch] = wall
    all_rows += rows
    for r in rows:
      print(json.dumps(r), flush=True)
    if args.out:
      with open(args.out, "a") as f:
        for r in rows:
          f.write(json.dumps(r) + "\n")
    print(f"== {arch}: wall {wall:.1f}s", flush=True)

  grid = cells(args.lengths, args.pairs)
  head = "arch".ljust(14) + "".join(f"T{t}/p{p}".rjust(10) for t, p in grid) + "      mean   wall_s"
  print(f"\nMQAR accuracy (held-out, {args.eval_samples} seqs/cell, chance {chance:.3f}; "
        f"{args.steps} steps x batch {args.batch}, seed {args.seed})")
  print(head)
  for arch in args.archs:
    accs = {(r["length"], r["pairs"]): r["accuracy"] for r in all_rows if r["arch"] == arch}
    print(arch.ljust(14) + "".join(f"{accs[c]:10.3f}" for c in grid)
          + f"{np.mean(list(accs.values())):10.3f}{walls[arch]:9.1f}")
  return all_rows


if __name__ == "__main__":
  main()
