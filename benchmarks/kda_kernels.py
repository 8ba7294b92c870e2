"""Times the KDA Pallas kernel vs the chunked XLA path (and fla's chunk_kda on GPU).

Usage (accelerator): python benchmarks/kda_kernels.py [--T 2048 8192 32768] [--out r.jsonl]
Implementations: pallas (fused forward kernel), pallas-split (XLA chunk_prep + Pallas
recurrence; same backward), chunked (XLA, impl="chunked"), fla (chunk_kda, GPU only).
Packing: unpacked (one sequence per row, segment_ids None: the kernels' fast path) and
packed (documents of random lengths around --doc-len, as segment_ids; fla gets them as
cu_seqlens, B = 1 only).
      (CPU check):   python benchmarks/kda_kernels.py --small     (interpret mode, tiny T)
Shapes: B=1, H=16, K=V=128, bf16 q/k/v/beta, fp32 bounded gates (lb=-5), chunk 64.
Timing: median of --repeats runs after one warm-up (compile excluded); JAX functions are
jitted and synchronised with block_until_ready, torch with CUDA events.

Cost model (DESIGN s1.3b): forward FLOP = B*T*HV*(6CK + 4CV + 6KV) (multiply-add = 2,
triangular products counted dense, the (I+L)^-1 not counted); fwd+bwd counts 3x forward
(the usual backward ~= 2x forward convention). Achieved TFLOP/s = FLOP / time; tokens/s =
B*T / time; vs_chunked = chunked time / this time (> 1: faster than XLA) for the same T,
mode and packing. Prints one JSON line per row as it is measured (prefixed "JSON ", also
appended to --out), then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from hybridmoe_jax.ops.kda import kda
from hybridmoe_jax.ops.kda.chunked import forward_flops
from benchmarks._timing import time_fn
from pallas_kernels.kda import kda_pallas
from pallas_kernels.kda.config import default_gpu_config, default_tpu_config

LB = -5.0


def make_inputs(B, T, H, K, V, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (B, T, H, K), jnp.float32)
  k = jax.random.normal(keys[1], (B, T, H, K), jnp.float32)
  q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
  v = jax.random.normal(keys[2], (B, T, H, V), jnp.float32)
  g = LB * jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H, K), jnp.float32))
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H), jnp.float32))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype)


def packed_segment_ids(B, T, doc_len, seed=0):
  """[B, T] int32 ids of documents with lengths uniform in [1, 2 doc_len - 1] (mean
  doc_len), so chunks hold starts at and between chunk boundaries."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((B, T), np.int32)
  for b in range(B):
    t, doc = 0, 0
    while t < T:
      n = int(rng.integers(1, 2 * doc_len))
      ids[b, t:t + n] = doc
      t, doc = t + n, doc + 1
  return jnp.asarray(ids)


def cu_seqlens(segment_ids):
  """Document boundaries of a [1, T] segment-id row, fla's cu_seqlens: [0, ..., T]."""
  ids = np.asarray(segment_ids)[0]
  starts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
  return np.concatenate([[0], starts, [ids.size]]).astype(np.int64)


def pallas_config(split, chunk, K, V, dtype):
  """The default heuristic config of this platform's kernel, fused or split forward."""
  if jax.default_backend() == "tpu":
    cfg = default_tpu_config(chunk_size=chunk, dtype=dtype)
  else:
    cfg = default_gpu_config(chunk_size=chunk, k=K, v=V, dtype=dtype)
  return dataclasses.replace(cfg, fused=not split)


def jax_fn(impl, mode, chunk, interpret, K, V, segment_ids):
  if impl.startswith("pallas"):
    cfg = pallas_config(impl == "pallas-split", chunk, K, V, jnp.bfloat16)
    run = functools.partial(kda_pallas, chunk_size=chunk, lower_bound=LB, interpret=interpret,
                            backend="tpu" if jax.default_backend() == "tpu" else "gpu",
                            config=cfg)
  else:
    run = functools.partial(kda, impl="chunked", chunk_size=chunk, lower_bound=LB)

  def fwd(q, k, v, g, beta):
    return run(q, k, v, g, beta, segment_ids=segment_ids)[0]

  if mode == "fwd":
    return jax.jit(fwd)

  def loss(*args):
    return jnp.sum(fwd(*args).astype(jnp.float32) ** 2)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def time_jax(fn, args, repeats):
  return time_fn(fn, args, repeats)[1]   # after a compile + warm-up call


def time_fla(args_np, mode, repeats, segment_ids=None):
  """fla's chunk_kda (safe_gate=True) on the same inputs; packed documents as cu_seqlens.
  Raises ImportError/TypeError (no fla, or an fla without these arguments)."""
  import torch
  from fla.ops.kda import chunk_kda

  dev = "cuda"
  q, k, v, g, beta = (torch.from_numpy(np.asarray(x, np.float32)).to(dev) for x in args_np)
  q, k, v, beta = (x.to(torch.bfloat16) for x in (q, k, v, beta))
  tensors = [q, k, v, g, beta]
  if mode == "fwd+bwd":
    tensors = [x.detach().requires_grad_(True) for x in tensors]
  packed = {}
  if segment_ids is not None:
    if segment_ids.shape[0] != 1:
      raise ValueError("fla takes packed documents as cu_seqlens: needs B = 1")
    packed = dict(cu_seqlens=torch.from_numpy(cu_seqlens(segment_ids)).to(dev))
  variants = [dict(safe_gate=True, lower_bound=LB, **packed), dict(safe_gate=True, **packed)]
  call, used = None, None
  for kw in variants:
    try:
      chunk_kda(*tensors, **kw)
      call, used = functools.partial(chunk_kda, **kw), kw
      break
    except TypeError:
      continue
  if call is None:
    raise TypeError("fla chunk_kda accepts neither safe_gate/lower_bound variant")

  def step():
    o = call(*tensors)[0]
    if mode == "fwd+bwd":
      o.float().pow(2).sum().backward()

  step()
  torch.cuda.synchronize()
  times = []
  for _ in range(repeats):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
  return statistics.median(times), used


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768])
  p.add_argument("--B", type=int, default=1)
  p.add_argument("--H", type=int, default=16)
  p.add_argument("--K", type=int, default=128)
  p.add_argument("--V", type=int, default=128)
  p.add_argument("--chunk", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
  p.add_argument("--impls", nargs="+", default=["pallas", "pallas-split", "chunked", "fla"],
                 choices=["pallas", "pallas-split", "chunked", "fla"],
                 help="pallas: fused forward kernel; pallas-split: XLA chunk_prep + Pallas "
                      "recurrence (same backward)")
  p.add_argument("--packing", nargs="+", default=["unpacked", "packed"],
                 choices=["unpacked", "packed"])
  p.add_argument("--doc-len", type=int, default=1024,
                 help="mean document length of the packed rows")
  p.add_argument("--small", action="store_true",
                 help="CPU check: T=64, H=2, K=V=32, documents ~24 tokens, "
                      "kernel interpreted")
  p.add_argument("--out", default=None, help="also append the JSON lines to this file")
  a = p.parse_args()
  platform = jax.default_backend()
  interpret = platform == "cpu"
  if interpret and not a.small:
    raise SystemExit("no accelerator: kernel timing is pending (needs a GPU/TPU); "
                     "run with --small to check this script in interpret mode")
  if a.small:
    a.T, a.H, a.K, a.V, a.repeats, a.doc_len = [64], 2, 32, 32, 1, 24
  # The XLA path first: every other row reports its speed relative to it.
  impls = sorted(a.impls, key=lambda i: i != "chunked")
  rows = []

  def emit(row):  # stream each row, so a time limit keeps what was measured
    rows.append(row)
    line = json.dumps(row)
    print("JSON " + line, flush=True)
    if a.out:
      with open(a.out, "a") as f:
        f.write(line + "\n")

  for T in a.T:
    args = make_inputs(a.B, T, a.H, a.K, a.V, jnp.bfloat16)
    flops = forward_flops(a.B * T, a.H, a.K, a.V, a.chunk)
    for packing in a.packing:
      seg = packed_segment_ids(a.B, T, a.doc_len) if packing == "packed" else None
      docs = 1 if seg is None else int(np.asarray(seg).max()) + 1
      for mode in a.modes:
        chunked_sec = None
        for impl in impls:
          row = dict(impl=impl, mode=mode, packing=packing, docs_per_row=docs, B=a.B, T=T,
                     H=a.H, K=a.K, V=a.V, chunk=a.chunk, dtype="bfloat16",
                     platform=platform, device=str(jax.devices()[0].device_kind),
                     interpret=interpret and impl.startswith("pallas"))
          try:
            if impl == "fla":
              if platform not in ("gpu", "cuda"):
                raise RuntimeError("fla needs a CUDA GPU")
              sec, used = time_fla(args, mode, a.repeats, seg)
              row["fla_kwargs"] = {k: v for k, v in used.items() if k != "cu_seqlens"}
            else:
              sec = time_jax(jax_fn(impl, mode, a.chunk, interpret, a.K, a.V, seg), args,
                             a.repeats)
          except Exception as e:  # noqa: BLE001 - report and keep benchmarking
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            emit(row)
            continue
          if impl == "chunked":
            chunked_sec = sec
          total = flops * (3 if mode == "fwd+bwd" else 1)
          row.update(ms=sec * 1e3, tokens_per_s=a.B * T / sec,
                     tflops=total / sec / 1e12, flop=total,
                     vs_chunked=None if chunked_sec is None else chunked_sec / sec)
          emit(row)
  print(f"{'impl':12} {'mode':8} {'packing':8} {'T':>6} {'ms':>10} {'Mtok/s':>9} "
        f"{'TFLOP/s':>8} {'vs XLA':>7}  note")
  for r in rows:
    head = f"{r['impl']:12} {r['mode']:8} {r['packing']:8} {r['T']:6}"
    if "error" in r:
      print(f"{head} {'-':>10} {'-':>9} {'-':>8} {'-':>7}  {r['error'][:60]}")
    else:
      note = "interpret mode: not a timing" if r["interpret"] else ""
      ratio = "-" if r["vs_chunked"] is None else f"{r['vs_chunked']:.2f}x"
      print(f"{head} {r['ms']:10.3f} {r['tokens_per_s'] / 1e6:9.3f} {r['tflops']:8.2f} "
            f"{ratio:>7}  {note}")


if __name__ == "__main__":
  main()
