"""Tests for the KDA op: recurrent reference, chunked XLA form, dispatcher (DESIGN s1). Every
implementation against the token recurrence: test_kda_contract.py."""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe_jax.ops.kda import kda
from hybridmoe_jax.ops.kda.chunked import kda_chunked
from hybridmoe_jax.ops.kda.recurrent import kda_recurrent
from pallas_kernels.kda.chunk_xla import diag_block_pairwise, intra_chunk_scores
from tests._support import assert_close, rel_rms

REFERENCE = pathlib.Path(__file__).resolve().parents[1] / "data" / "kda_reference.npz"
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def l2norm(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed, B, T, H, HV, K, V, gate="unbounded", lower_bound=-5.0, strength=1.0):
  """Random fp32 inputs: q, k, v, g, beta, h0, do, dht (numpy)."""
  rng = np.random.default_rng(seed)
  q = l2norm(rng.normal(size=(B, T, H, K)))
  k = l2norm(rng.normal(size=(B, T, H, K)))
  v = rng.normal(size=(B, T, HV, V))
  x = rng.normal(size=(B, T, HV, K)) * 2.0
  if gate == "bounded":
    g = lower_bound / (1.0 + np.exp(-x))
  else:  # -exp(A_log) softplus(x): mostly slow decays with a tail of fast ones
    g = -strength * np.logaddexp(0.0, x - 2.0)
  beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(B, T, HV))))
  h0 = rng.normal(size=(B, HV, K, V))
  do = rng.normal(size=(B, T, HV, V))
  dht = rng.normal(size=(B, HV, K, V))
  return tuple(a.astype(np.float32) for a in (q, k, v, g, beta, h0, do, dht))


@functools.lru_cache(maxsize=None)
def fwd_bwd(impl, use_h0, **kw):
  """Jitted (o, ht, grads) of L = sum(o * do) + sum(ht * dht) for one implementation."""

  def loss(q, k, v, g, beta, h0, do, dht, seg):
    o, ht = impl(
        q, k, v, g, beta, initial_state=h0 if use_h0 else None,
        output_final_state=True, segment_ids=seg, **kw,
    )
    return jnp.sum(o * do) + jnp.sum(ht * dht), (o, ht)

  argnums = (0, 1, 2, 3, 4, 5) if use_h0 else (0, 1, 2, 3, 4)
  grad_fn = jax.value_and_grad(loss, argnums=argnums, has_aux=True)

  @jax.jit
  def run(q, k, v, g, beta, h0, do, dht, seg=None):
    (_, (o, ht)), grads = grad_fn(q, k, v, g, beta, h0, do, dht, seg)
    return o, ht, grads

  return run


@functools.lru_cache(maxsize=None)
def jit_kda(**static):
  """kda jitted with its static keyword arguments bound (compiles once per shape)."""
  return jax.jit(functools.partial(kda, **static))


@pytest.mark.parametrize("strength", [10.0, 25.0])
def test_chunked_unbounded_strong_gates(strength):
  """Realistic unbounded gates (per-token log decays down to about -20 / -50): the
  pairwise/anchored-below-zero chunked path stays finite and equals the recurrence."""
  q, k, v, g, beta, h0, do, dht = make_inputs(7, 1, 100, 2, 2, 16, 16, strength=strength)
  assert g.min() < -2 * strength
  ref = fwd_bwd(kda_recurrent, True)(q, k, v, g, beta, h0, do, dht)
  out = fwd_bwd(kda_chunked, True, chunk_size=32)(q, k, v, g, beta, h0, do, dht)
  for x in jax.tree.leaves(out):
    assert np.isfinite(np.asarray(x)).all()
  assert rel_rms(out[0], ref[0]) < 1e-5
  for name, d, d_ref in zip(GRAD_NAMES, out[2], ref[2]):
    assert rel_rms(d, d_ref) < 1e-5, name


# --- independent references ------------------------------------------------------------


@pytest.mark.parametrize("case,impl,kw", [
    ("basic", kda_recurrent, ()),
    ("grouped_h0", kda_recurrent, ()),
    ("slow_decay", kda_recurrent, ()),
    ("basic", kda_chunked, (("chunk_size", 32), ("lower_bound", -5.0))),
    ("grouped_h0", kda_chunked, ()),
    ("slow_decay", kda_chunked, (("chunk_size", 16), ("lower_bound", -5.0))),
])
def test_fla_reference(case, impl, kw):
  data = np.load(REFERENCE)
  a = {name: data[f"{case}/{name}"] for name in
       ("q", "k", "v", "g", "beta", "h0", "do", "dht", "o", "ht") + GRAD_NAMES}
  if kw and a["g"].min() < -5.0:
    pytest.skip("gates not bounded by -5")
  o, ht, grads = fwd_bwd(impl, True, **dict(kw))(
      a["q"], a["k"], a["v"], a["g"], a["beta"], a["h0"], a["do"], a["dht"]
  )
  assert_close(o, a["o"], 1e-5, "o")
  assert_close(ht, a["ht"], 1e-5, "ht")
  for name, d in zip(GRAD_NAMES, grads):
    assert_close(d, a[name], 1e-5, name)


def numpy_kda_f64(q, k, v, g, beta, h0, seg):
  """Plain float64 loops over batch, value head and token (DESIGN s1)."""
  B, T, H, K = q.shape
  HV, V = v.shape[2:]
  o = np.zeros((B, T, HV, V))
  S_out = np.zeros((B, HV, K, V))
  for b in range(B):
    for h in range(HV):
      hq = h // (HV // H)
      S = h0[b, h].astype(np.float64)
      for t in range(T):
        if t > 0 and seg[b, t] != seg[b, t - 1]:
          S = np.zeros((K, V))
        kt = k[b, t, hq].astype(np.float64)
        S = np.exp(g[b, t, h].astype(np.float64))[:, None] * S
        S = S + beta[b, t, h] * np.outer(kt, v[b, t, h] - kt @ S)
        o[b, t, h] = (K**-0.5 * q[b, t, hq].astype(np.float64)) @ S
      S_out[b, h] = S
  return o, S_out


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_float64_numpy_rederivation(impl):
  q, k, v, g, beta, h0, _, _ = make_inputs(3, 2, 40, 1, 2, 8, 6)
  seg = np.array([[0] * 13 + [1] * 27, [5] * 30 + [2] * 9 + [5]], np.int32)
  o_ref, s_ref = numpy_kda_f64(q, k, v, g, beta, h0, seg)
  o, s = jit_kda(impl=impl, chunk_size=16, output_final_state=True)(
      q, k, v, g, beta, initial_state=h0, segment_ids=seg
  )
  assert rel_rms(o, o_ref) < 1e-5
  assert rel_rms(s, s_ref) < 1e-5


# --- packed sequences --------------------------------------------------------------------

# Row 0 has boundaries on 16-chunk edges (16, 48, 64) and inside chunks (26); row 1 has a
# one-token document. Ids only need to change at a boundary (they alternate here).
DOCS = [[16, 10, 22, 16, 36], [5, 40, 1, 54]]


@pytest.mark.parametrize("impl,kw", [
    ("recurrent", {}),
    ("chunked", {"chunk_size": 16}),
    ("chunked", {"chunk_size": 32}),
    ("chunked", {"chunk_size": 16, "lower_bound": -5.0}),
])
def test_packed_equals_separate(impl, kw):
  T = 100
  q, k, v, g, beta, h0, _, _ = make_inputs(11, 2, T, 2, 4, 16, 16, "bounded")
  seg = np.stack([np.repeat(np.arange(len(d)) % 2, d) for d in DOCS]).astype(np.int32)
  o, ht = jit_kda(impl=impl, output_final_state=True, **kw)(
      q, k, v, g, beta, initial_state=h0, segment_ids=seg
  )
  o_sep, ht_sep = separate_documents()
  np.testing.assert_allclose(o, o_sep, rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(ht, ht_sep, rtol=1e-5, atol=2e-6)


@functools.lru_cache(maxsize=1)
def separate_documents():
  """Each document of DOCS run alone by the reference (the packed tests' expectation)."""
  q, k, v, g, beta, h0, _, _ = make_inputs(11, 2, 100, 2, 4, 16, 16, "bounded")
  run = jit_kda(impl="recurrent", output_final_state=True)
  outs, finals = [], []
  for b, lengths in enumerate(DOCS):
    parts, start = [], 0
    for i, length in enumerate(lengths):
      doc = [x[b : b + 1, start : start + length] for x in (q, k, v, g, beta)]
      # The initial state belongs to the first document only.
      o_d, ht_d = run(*doc, initial_state=h0[b : b + 1] if i == 0 else None)
      parts.append(o_d)
      start += length
    outs.append(np.concatenate(parts, axis=1))
    finals.append(ht_d)  # the last document's final state
  return np.concatenate(outs), np.concatenate(finals)


# --- why the gate must be bounded ---------------------------------------------------------


def block_inputs(seed, gate, n=16):
  """a, b [4, n, 32] unit rows, G [4, n, 32] their cumulative gate, g the gates."""
  rng = np.random.default_rng(seed)
  a = l2norm(rng.normal(size=(4, n, 32))).astype(np.float32)
  b = l2norm(rng.normal(size=(4, n, 32))).astype(np.float32)
  x = rng.normal(size=(4, n, 32)) * 2.0
  if gate == "bounded":
    g = -5.0 / (1.0 + np.exp(-x))
  else:  # unbounded, A_log = log(10): per-token log decays reach -20 .. -50
    g = -10.0 * np.logaddexp(0.0, x)
  return a, b, np.cumsum(g, axis=-2).astype(np.float32), g.astype(np.float32)


def scores_f64(a, b, g):
  """Causal decay-weighted scores sum_c a_i b_j exp(G_i - G_j), float64 loops."""
  G = np.cumsum(g.astype(np.float64), axis=-2)
  n = a.shape[-2]
  out = np.zeros(a.shape[:-2] + (n, n))
  for i in range(n):
    for j in range(i + 1):
      out[..., i, j] = np.sum(a[..., i, :] * b[..., j, :] * np.exp(G[..., i, :] - G[..., j, :]), -1)
  return out


def test_anchored_block_overflows_unbounded_but_not_bounded():
  """The chunk scores of both gate paths (48 tokens: diagonal, neighbouring and distant
  16-blocks) against float64; the anchored path needs the bound, the pairwise one not."""
  a, b, _, g = block_inputs(0, "unbounded", n=48)
  assert g.min() < -20.0
  anchored = np.asarray(intra_chunk_scores(a, b, g, None, -5.0)[0])
  assert not np.isfinite(anchored).all()  # e^(+-anchored exponent) overflows fp32
  pairwise = np.asarray(intra_chunk_scores(a, b, g, None, None)[0])
  assert np.isfinite(pairwise).all()
  assert rel_rms(pairwise, scores_f64(a, b, g)) < 1e-5

  a, b, _, g = block_inputs(1, "bounded", n=48)
  ref = scores_f64(a, b, g)
  for lb in (-5.0, None):
    a_qk, a_kk = (np.asarray(x) for x in intra_chunk_scores(a, b, g, None, lb))
    assert np.isfinite(a_qk).all()
    assert rel_rms(a_qk, ref) < 1e-5, lb
    assert rel_rms(a_kk, scores_f64(b, b, g)) < 1e-5, lb


def test_pairwise_block_gradients_finite_for_unbounded_gates():
  a, b, G, _ = block_inputs(2, "unbounded")
  loss = lambda *xs: jnp.sum(diag_block_pairwise(*xs) ** 2)  # noqa: E731
  grads = jax.grad(loss, argnums=(0, 1, 2))(a, b, G)
  assert all(np.isfinite(np.asarray(x)).all() for x in grads)


@pytest.mark.parametrize("m", [9, 21, 40])
def test_anchor_is_causal(m):
  """Changing token m's gate leaves score rows 0..m-1 bit-identical (the anchors are the
  blocks' first rows; later block sums only reach masked entries)."""
  a, b, _, g = block_inputs(3, "bounded", n=48)
  g2 = g.copy()
  g2[:, m] = -4.9
  A1, A2 = (np.asarray(intra_chunk_scores(a, b, x, None, -5.0)[0]) for x in (g, g2))
  np.testing.assert_array_equal(A1[:, :m], A2[:, :m])
  assert not np.array_equal(A1[:, m:], A2[:, m:])


# --- dispatcher ---------------------------------------------------------------------------


def test_dispatcher_impls():
  q, k, v, g, beta, h0, _, _ = make_inputs(5, 1, 40, 2, 2, 16, 16, "bounded")
  args = (q, k, v, g, beta)
  auto = jit_kda(output_final_state=True, chunk_size=16)(*args, initial_state=h0)
  chunked = jit_kda(impl="chunked", output_final_state=True, chunk_size=16)(
      *args, initial_state=h0
  )
  np.testing.assert_array_equal(auto[0], chunked[0])  # on CPU auto == chunked
  np.testing.assert_array_equal(auto[1], chunked[1])
  o, ht = jit_kda(impl="recurrent")(*args)
  assert o.shape == (1, 40, 2, 16) and o.dtype == jnp.float32 and ht is None
  # The kernel needs the bounded gate: an unbounded call is refused, never recomputed.
  with pytest.raises(NotImplementedError, match="bounded gate"):
    kda(*args, impl="pallas")
  # Traced gates cannot be range-checked and must not raise.
  jax.jit(lambda g_: kda(q, k, v, g_, beta, lower_bound=-5.0)[0])(g)


def test_bf16_inputs():
  q, k, v, g, beta, h0, _, _ = make_inputs(6, 1, 50, 2, 2, 16, 16)
  ref, _ = jit_kda(impl="recurrent")(q, k, v, g, beta)
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  o, ht = jit_kda(output_final_state=True, chunk_size=32)(*bf, g, beta)
  assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32
  assert rel_rms(o.astype(jnp.float32), ref) < 2e-2


def _bad(**over):
  q, k, v, g, beta, h0, _, _ = make_inputs(8, 2, 20, 2, 4, 8, 8)
  kw = dict(q=q, k=k, v=v, g=g, beta=beta)
  kw.update(over)
  return kw


@pytest.mark.parametrize("over,match", [
    (dict(q=np.zeros((2, 20, 8), np.float32)), "q must have rank 4"),
    (dict(beta=np.zeros((2, 20, 4, 1), np.float32)), "beta must have rank 3"),
    (dict(k=np.zeros((2, 20, 2, 4), np.float32)), r"k must have the shape of q"),
    (dict(v=np.zeros((2, 21, 4, 8), np.float32)), r"v must have batch/time"),
    (dict(v=np.zeros((2, 20, 3, 8), np.float32)), "multiple of q/k heads"),
    (dict(g=np.zeros((2, 20, 2, 8), np.float32)), r"g must have shape \[B, T, HV, K\]"),
    (dict(beta=np.zeros((2, 20, 2), np.float32)), r"beta must have shape \[B, T, HV\]"),
    (dict(initial_state=np.zeros((2, 4, 8, 7), np.float32)), r"initial_state must have shape"),
    (dict(segment_ids=np.zeros((2, 19), np.int32)), r"segment_ids must have shape \[B, T\]"),
    (dict(segment_ids=np.zeros((2, 20), np.float32)), "segment_ids must be an integer"),
    (dict(impl="triton"), "impl must be one of"),
    (dict(chunk_size=48), "chunk_size must be a power of two"),
    (dict(chunk_size=8), "chunk_size must be a power of two"),
    (dict(lower_bound=-6.0), r"lower_bound must be in \[-5.0, 0\)"),
    (dict(lower_bound=0.0), r"lower_bound must be in \[-5.0, 0\)"),
    (dict(g=np.full((2, 20, 4, 8), 0.1, np.float32), lower_bound=-5.0), "g must be <= 0"),
    (dict(g=np.full((2, 20, 4, 8), -7.0, np.float32), lower_bound=-5.0),
     "g must be >= lower_bound"),
])
def test_bad_inputs(over, match):
  kw = _bad(**over)
  with pytest.raises(ValueError, match=match):
    kda(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"), **kw)


def test_chunked_validates_chunk_size():
  kw = _bad()
  with pytest.raises(ValueError, match="chunk_size"):
    kda_chunked(*kw.values(), chunk_size=24)
