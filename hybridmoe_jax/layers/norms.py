"""RMSNorm, computed in fp32 and returned in the input dtype."""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) * scale over the last axis; fp32 inside."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  return y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned gain [dim] (fp32, initialised to 1)."""

  def __init__(self, dim: int, *, eps: float = 1e-5):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)
