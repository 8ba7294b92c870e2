"""Inputs and a jitted value-and-gradients runner shared by the attention tests."""

import jax
import jax.numpy as jnp
import numpy as np


def attention_inputs(seed, b, tq, tk, h, hk, d, dv, dtype=jnp.float32):
  """q [b, tq, h, d], k [b, tk, hk, d], v [b, tk, hk, dv] in dtype; w [b, tq, h, dv] fp32: a
  random cotangent."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, tq, h, d)), dtype)
  k = jnp.asarray(rng.standard_normal((b, tk, hk, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, tk, hk, dv)), dtype)
  w = jnp.asarray(rng.standard_normal((b, tq, h, dv)), jnp.float32)
  return q, k, v, w


def packed_segments(seed, b, t):
  """Sorted document ids 1..3 per row with a padding (0) suffix: packed rows."""
  seg = np.sort(np.random.default_rng(seed).integers(1, 4, (b, t)), axis=1).astype(np.int32)
  seg[:, t - 2:] = 0
  return jnp.asarray(seg)


def value_and_grads(fn, q, k, v, w):
  """fn's output and the gradients of <fn, w>, in one jitted program (op by op, every
  primitive of the blockwise scans or of an interpreted kernel's grid loop compiles on its
  own: several times the CPU)."""
  @jax.jit
  def run(q, k, v, w):
    out, pullback = jax.vjp(fn, q, k, v)
    return (out,) + pullback(w.astype(out.dtype))
  return run(q, k, v, w)


