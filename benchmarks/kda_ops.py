"""Times KDA impl="chunked" against impl="recurrent" (the token scan): fwd and fwd+bwd.

Usage: python benchmarks/kda_ops.py [--T 1024 4096 16384] [--repeats 7] [--lower-bound -5]
                                    [--chunk 32 64] [--modes fwd fwd+bwd]
Every implementation is jitted and compiled first; then the timed calls are interleaved
(round r runs each implementation once, in a rotating order), so load from other processes
hits all of them alike. Reports medians and the ratio chunked / recurrent (< 1: chunked is
faster) per row, then one JSON line per row (prefixed "JSON ").
No outside KDA implementation is importable here (tokamax 0.0.17 ships no KDA op; MaxText
is not installed), so none is timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from hybridmoe_jax.ops.kda import kda
from benchmarks._timing import time_fns


def make_inputs(B, T, H, K, V, lower_bound, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (B, T, H, K), jnp.float32)
  k = jax.random.normal(keys[1], (B, T, H, K), jnp.float32)
  q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
  v = jax.random.normal(keys[2], (B, T, H, V), jnp.float32)
  x = jax.random.normal(keys[3], (B, T, H, K), jnp.float32)
  lb = -5.0 if lower_bound is None else lower_bound
  g = lb * jax.nn.sigmoid(x)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H), jnp.float32))
  return q, k, v, g, beta


def build(impl, chunk_size, lower_bound, backward):
  kw = dict(impl=impl, chunk_size=chunk_size, lower_bound=lower_bound)

  def fwd(q, k, v, g, beta):
    return kda(q, k, v, g, beta, **kw)[0]

  if not backward:
    return jax.jit(fwd)

  def loss(*args):
    return jnp.sum(fwd(*args) ** 2)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--B", type=int, default=1)
  p.add_argument("--H", type=int, default=4)
  p.add_argument("--K", type=int, default=64)
  p.add_argument("--V", type=int, default=64)
  p.add_argument("--chunk", type=int, nargs="+", default=[64],
                 help="chunk sizes of the chunked path (each timed in the same rounds)")
  p.add_argument("--lower-bound", type=float, default=None,
                 help="bounded gate in [lb, 0]: the chunked path's anchored diagonal blocks")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
  args = p.parse_args()

  print(f"backend={jax.default_backend()} devices={jax.devices()} jax={jax.__version__}")
  chunk_cols = " ".join(f"{f'C{c} ms':>9} {f'C{c}/rec':>8}" for c in args.chunk)
  header = f"{'T':>6} {'mode':>8} {'rec ms':>9} {chunk_cols}"
  print(header)
  print("-" * len(header))
  rows = []
  for T in args.T:
    inputs = make_inputs(args.B, T, args.H, args.K, args.V, args.lower_bound)
    for mode in args.modes:
      backward = mode == "fwd+bwd"
      fns = {"recurrent": build("recurrent", 64, None, backward)}
      for c in args.chunk:
        fns[f"chunked_c{c}"] = build("chunked", c, args.lower_bound, backward)
      timed = time_fns({name: functools.partial(fn, *inputs) for name, fn in fns.items()},
                       args.repeats)
      first, med = ({name: t[i] for name, t in timed.items()} for i in (0, 1))
      rec = med["recurrent"]
      cells = []
      for c in args.chunk:
        chk = med[f"chunked_c{c}"]
        cells.append(f"{chk * 1e3:>9.1f} {chk / rec:>8.2f}")
        rows.append(dict(op="kda", T=T, B=args.B, H=args.H, K=args.K, V=args.V, chunk=c,
                         lower_bound=args.lower_bound, mode=mode, repeats=args.repeats,
                         recurrent_ms=rec * 1e3, chunked_ms=chk * 1e3,
                         ratio_chunked_over_recurrent=chk / rec,
                         first_call_s_recurrent=first["recurrent"],
                         first_call_s_chunked=first[f"chunked_c{c}"],
                         backend=jax.default_backend()))
      print(f"{T:>6} {mode:>8} {rec * 1e3:>9.1f} {' '.join(cells)}", flush=True)
  for row in rows:
    print("JSON " + json.dumps(row))


if __name__ == "__main__":
  main()
