"""The blocked cross-entropy (ops.cross_entropy) against the whole-logits reference, forward
and backward, with a vocabulary that the block does not divide."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe_jax.ops.cross_entropy import blocked_token_nll, token_nll


def _inputs(b=2, t=5, d=12, v=37, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  h = jax.random.normal(k1, (b, t, d), jnp.float32)
  w = jax.random.normal(k2, (d, v), jnp.float32) * 0.5
  targets = jax.random.randint(k3, (b, t), 0, v)
  return h, w, targets


@pytest.mark.parametrize("block", [1, 8, 10, 36, 37, 64])
def test_blocked_matches_reference_forward_and_backward(block):
  h, w, targets = _inputs()
  weights = jnp.linspace(0.0, 1.0, targets.size).reshape(targets.shape)
  ref_loss = lambda h, w: jnp.sum(token_nll(h @ w, targets) * weights)
  loss = lambda h, w: jnp.sum(blocked_token_nll(h, w, targets, block=block) * weights)
  np.testing.assert_allclose(blocked_token_nll(h, w, targets, block=block),
                             token_nll(h @ w, targets), rtol=1e-5, atol=1e-5)
  got, want = jax.grad(loss, (0, 1))(h, w), jax.grad(ref_loss, (0, 1))(h, w)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_targets_in_every_block_and_the_last_column():
  h, w, _ = _inputs(b=1, t=4, v=37)
  targets = jnp.array([[0, 15, 16, 36]])   # block 16: the first, second, third's edges
  np.testing.assert_allclose(blocked_token_nll(h, w, targets, block=16),
                             token_nll(h @ w, targets), rtol=1e-5, atol=1e-5)


def test_blocked_program_never_holds_the_whole_logits():
  """The compiled loss and its gradient hold no [B, T, V] array: only [B, T, block] ones."""
  h, w, targets = _inputs(b=2, t=6, d=8, v=4096)
  loss = lambda h, w: jnp.sum(blocked_token_nll(h, w, targets, block=512))
  hlo = jax.jit(jax.grad(loss, (0, 1))).lower(h, w).compile().as_text()
  assert "f32[2,6,512]" in hlo
  assert "f32[2,6,4096]" not in hlo


def test_bad_block_is_refused():
  h, w, targets = _inputs()
  with pytest.raises(ValueError, match="block = 0"):
    blocked_token_nll(h, w, targets, block=0)
