"""Small-block pieces of the chunked KDA form (DESIGN s1.1-1.3).

Conventions: one block of n (<= 16) tokens, with any leading batch dims `...`.
diag_block_pairwise: a, b: [..., n, K] row/column features (q or k); G: [..., n, K] float32
cumulative log decay over the block (any constant offset per channel); result [..., n, n]
float32 with

    A[i, j] = sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c])   for i >= j, and 0 above the diagonal.

The decay is per channel, so it cannot leave the channel sum: the pairwise form builds the
[n, n, K] decay tensor and is safe for any gate. (The bounded gate's alternative, one matmul
of anchored factor pairs, lives in kda_chunked._decays / _scores.)
invert_unit_lower: (I + L)^-1 of strictly lower 16 x 16 blocks, from matmuls only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def causal_mask(n: int) -> jax.Array:
  """[n, n] bool, True on and below the diagonal (i >= j)."""
  return jnp.tril(jnp.ones((n, n), bool))


def diag_block_pairwise(a: jax.Array, b: jax.Array, G: jax.Array) -> jax.Array:
  """Lower-triangular block via the [..., n, n, K] pairwise decay tensor; any gate <= 0.

  Args:
    a, b: [..., n, K] row and column features (leading dims broadcast together).
    G: [..., n, K] float32 cumulative log decay.

  Returns:
    A: [..., n, n] float32, zero above the diagonal.
  """
  keep = causal_mask(G.shape[-2])
  diff = G[..., :, None, :] - G[..., None, :, :]  # [..., n, n, K]
  # Mask the exponent, not the exp: above the diagonal diff > 0 and may overflow, and
  # where(mask, exp(diff), 0) would turn that inf into a NaN gradient.
  decay = jnp.exp(jnp.where(keep[..., None], diff, -jnp.inf))
  weighted = b[..., None, :, :].astype(jnp.float32) * decay  # [..., i, j, K]
  # A row-vector x matrix contraction per row i. Written this way (not as one fused
  # product-and-sum) XLA CPU stays fast when `a` carries an extra broadcast dim, as in
  # kda_chunked, where q and k rows share one decay tensor.
  return jnp.einsum("...ic,...ijc->...ij", a.astype(jnp.float32), weighted, precision=_HIGHEST)


def invert_unit_lower(L: jax.Array) -> jax.Array:
  """(I + L)^-1 for strictly lower-triangular L: [..., n, n] float32, n <= 16.

  L is nilpotent (L^n = 0), so (I + L)^-1 = sum_p (-L)^p = (I - L)(I + L^2)(I + L^4)(I + L^8)
  exactly: three squarings and three products, all matmuls (no sequential row loop), then
  one Newton refinement step.
  """
  n = L.shape[-1]
  if n > 16:
    raise ValueError(f"invert_unit_lower handles n <= 16, got L of shape {L.shape}")
  eye = jnp.eye(n, dtype=L.dtype)
  inv = eye - L
  power = L
  for _ in range(3):  # L^2, L^4, L^8
    power = jnp.matmul(power, power, precision=_HIGHEST)
    inv = jnp.matmul(inv, eye + power, precision=_HIGHEST)
  # One Newton step X <- X (2I - (I + L) X): the product form loses ~1e-4 when keys are
  # nearly parallel with gates ~ 0 and beta ~ 1; the step squares that residual away.
  residual = eye - jnp.matmul(eye + L, inv, precision=_HIGHEST)
  return inv + jnp.matmul(inv, residual, precision=_HIGHEST)
