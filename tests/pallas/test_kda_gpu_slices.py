"""The GPU split path one slice at a time (kernel_gpu.sliced_forward / sliced_backward) vs the
token recurrence, in interpret mode on CPU: several slices (SLICE_CHUNKS lowered so a short
sequence spans them, the last slice padded), grouped value heads, packed documents whose
boundaries fall inside and between slices. fp32 inputs, 1e-5 relative RMS (fla's rule)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe_jax.ops.kda.recurrent import kda_recurrent
from pallas_kernels.kda import kernel_gpu
from pallas_kernels.kda.config import GpuConfig
from pallas_kernels.kda.prep import chunk_prep
from pallas_kernels.kda.segments import chunk_local_segments
from tests._support import assert_close

LB, C = -5.0, 16


def _inputs(T, H, HV, K, V, seed=0):
  rng = np.random.default_rng(seed)
  l2 = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  return dict(
      q=f(l2(rng.normal(size=(1, T, H, K)))), k=f(l2(rng.normal(size=(1, T, H, K)))),
      v=f(rng.normal(size=(1, T, HV, V))),
      g=f(LB / (1.0 + np.exp(-2.0 * rng.normal(size=(1, T, HV, K))))),
      beta=f(1.0 / (1.0 + np.exp(-rng.normal(size=(1, T, HV))))),
      h0=f(rng.normal(size=(1, HV, K, V))), do=f(rng.normal(size=(1, T, HV, V))),
      dht=f(rng.normal(size=(1, HV, K, V))))


def _reference(x, segment_ids):
  """(o, ht) and the gradients of sum(o do) + sum(ht dht) by the token recurrence."""
  def f(q, k, v, g, beta, h0):
    return kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         segment_ids=segment_ids)

  (o, ht), vjp = jax.vjp(f, x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])
  return o, ht, vjp((x["do"], x["dht"]))


@pytest.mark.parametrize("T,H,HV,packed", [(100, 1, 2, False), (70, 1, 1, True)])
def test_sliced_split_path_matches_recurrence(monkeypatch, T, H, HV, packed):
  monkeypatch.setattr(kernel_gpu, "SLICE_CHUNKS", 2)   # T=100: 7 chunks -> 4 slices of 2
  K, V = 16, 32   # two value tiles of 16: the score kernel splits them in two groups
  x = _inputs(T, H, HV, K, V)
  cfg = GpuConfig(chunk_size=C, block_v=16, fused=False)
  ids = None
  seg = None
  if packed:  # documents of 20, 30, 20 tokens: starts inside chunk 1 and chunk 3
    ids = jnp.asarray([[0] * 20 + [1] * 30 + [2] * 20], jnp.int32)
    tp = -(-T // C) * C
    seg = chunk_local_segments(jnp.pad(ids, ((0, 0), (0, tp - T)), mode="edge"), C)
  prep_fn = functools.partial(chunk_prep, scale=K ** -0.5, lower_bound=LB, chunk_size=C)
  BHV = HV
  s0t = jnp.swapaxes(x["h0"], -1, -2).reshape(BHV, V, K)
  dht_t = jnp.swapaxes(x["dht"], -1, -2).reshape(BHV, V, K)
  tp = -(-T // C) * C
  pad = lambda a: jnp.pad(a, [(0, 0), (0, tp - T)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
  ins = [pad(x[n]) for n in ("q", "k", "v", "g", "beta")]

  @jax.jit
  def run(ins, seg, s0t, do, dht_t):
    o, ht_t = kernel_gpu.sliced_forward(*ins, seg, s0t, prep_fn=prep_fn, cfg=cfg,
                                        interpret=True)
    grads, ds0t = kernel_gpu.sliced_backward(*ins, seg, s0t, do, dht_t, prep_fn=prep_fn,
                                             cfg=cfg, interpret=True)
    return o, ht_t, grads, ds0t

  o, ht_t, grads, ds0t = run(ins, seg, s0t, pad(x["do"]), dht_t)
  o_ref, ht_ref, grads_ref = _reference(x, ids)
  assert_close(o[:, :T], o_ref, 1e-5, "o")
  assert_close(jnp.swapaxes(ht_t.reshape(1, HV, V, K), -1, -2), ht_ref, 1e-5, "ht")
  for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, grads_ref):
    assert got.shape == ins[0].shape[:2] + want.shape[2:], name
    assert_close(got[:, :T], want, 1e-5, name)
  assert_close(jnp.swapaxes(ds0t.reshape(1, HV, V, K), -1, -2), grads_ref[5], 1e-5, "dh0")


def test_slice_plan_pads_fewest_chunks():
  assert kernel_gpu.slice_plan(1) == (1, 1)
  assert kernel_gpu.slice_plan(128) == (16, 8)
  assert kernel_gpu.slice_plan(129) == (17, 8)     # 136 chunks
  assert kernel_gpu.slice_plan(20) == (3, 7)       # 21 chunks, not 24
  assert kernel_gpu.slice_plan(8) == (1, 8)
