"""Short causal depthwise convolution that never reads across packed documents."""

import jax
import jax.numpy as jnp
from flax import nnx


class ShortConv(nnx.Module):
  """y_t = SiLU(sum_j w[j] * x_{t-j}) over taps j < kernel, per channel, no bias.

  Weights [kernel, C] are fp32. Taps reaching into an earlier segment (packed sequences) or
  before the start of the sequence read zeros, so documents stay independent.
  """

  def __init__(self, channels: int, kernel: int, *, rngs: nnx.Rngs):
    self.kernel = kernel
    w = jax.random.normal(rngs.params(), (kernel, channels), jnp.float32) * kernel ** -0.5
    self.weight = nnx.Param(w)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """x: [B, T, C] -> [B, T, C] in x's dtype; segment_ids: [B, T] int32 or None."""
    w = self.weight[...]
    x32 = x.astype(jnp.float32)
    y = x32 * w[0]
    for j in range(1, self.kernel):
      shifted = jnp.pad(x32, ((0, 0), (j, 0), (0, 0)))[:, :-j]
      if segment_ids is not None:
        seg_shift = jnp.pad(segment_ids, ((0, 0), (j, 0)), constant_values=-1)[:, :-j]
        shifted = jnp.where((seg_shift == segment_ids)[..., None], shifted, 0.0)
      y = y + shifted * w[j]
    return jax.nn.silu(y).astype(x.dtype)
