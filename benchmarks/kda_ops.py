"""Times KDA impl="chunked" vs impl="recurrent": forward and forward+backward.

Usage: python benchmarks/kda_ops.py --T 1024 4096 16384 [--repeats 3] [--lower-bound -5]
Prints a table, then one JSON line per row (machine-readable, prefixed "JSON ").
Times are the median of --repeats runs after one warm-up (compile excluded), jitted,
with block_until_ready. FLOP/s uses DESIGN s1.3b's forward cost model for the chunked form.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe_jax.ops import kda
from hybridmoe_jax.timing import time_fn


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




def chunked_fwd_flops(B, T, H, K, V, C):
  """DESIGN s1.3b: ~6CK + 4CV + 6KV FLOP per token per head (inverse not counted)."""
  return B * T * H * (6 * C * K + 4 * C * V + 6 * K * V)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
  p.add_argument("--B", type=int, default=1)
  p.add_argument("--H", type=int, default=4)
  p.add_argument("--K", type=int, default=64)
  p.add_argument("--V", type=int, default=64)
  p.add_argument("--chunk", type=int, default=64)
  p.add_argument("--lower-bound", type=float, default=None,
                 help="use the bounded-gate (dense diagonal block) chunked path")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
  args = p.parse_args()

  print(f"backend={jax.default_backend()} devices={jax.devices()} jax={jax.__version__}")
  header = f"{'T':>6} {'mode':>8} {'recurrent ms':>13} {'chunked ms':>11} {'rec/chunk':>9} " \
           f"{'chunk GFLOP/s':>13} {'1st call s (rec, chunk)':>23}"
  print(header)
  print("-" * len(header))
  rows = []
  for T in args.T:
    inputs = make_inputs(args.B, T, args.H, args.K, args.V, args.lower_bound)
    for mode in args.modes:
      res = {}
      for impl in ("recurrent", "chunked"):
        fn = build(impl, args.chunk, args.lower_bound, mode == "fwd+bwd")
        res[impl] = time_fn(fn, inputs, args.repeats)
      rec, chk = res["recurrent"][1], res["chunked"][1]
      flops = chunked_fwd_flops(args.B, T, args.H, args.K, args.V, args.chunk)
      gflops = flops / chk / 1e9 if mode == "fwd" else float("nan")
      row = dict(op="kda", T=T, B=args.B, H=args.H, K=args.K, V=args.V, chunk=args.chunk,
                 lower_bound=args.lower_bound, mode=mode, recurrent_ms=rec * 1e3,
                 chunked_ms=chk * 1e3, ratio_recurrent_over_chunked=rec / chk,
                 chunked_fwd_gflops=None if np.isnan(gflops) else gflops,
                 first_call_s_recurrent=res["recurrent"][0],
                 first_call_s_chunked=res["chunked"][0],
                 backend=jax.default_backend())
      rows.append(row)
      print(f"{T:>6} {mode:>8} {rec * 1e3:>13.1f} {chk * 1e3:>11.1f} {rec / chk:>9.2f} "
            f"{gflops:>13.2f} {res['recurrent'][0]:>11.1f} {res['chunked'][0]:>11.1f}",
            flush=True)
  for row in rows:
    print("JSON " + json.dumps(row))


if __name__ == "__main__":
  main()
