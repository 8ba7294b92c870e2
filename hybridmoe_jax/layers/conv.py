"""Short causal depthwise convolution that never reads across packed documents."""

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.ops.conv import short_conv


class ShortConv(nnx.Module):
  """y_t = SiLU(sum_j w[j] * x_{t-j}) over taps j < kernel, per channel, no bias.

  Weights [kernel, C] are fp32. Without a cache, taps reaching into an earlier segment
  (packed sequences) or before the start of the sequence read zeros, so documents stay
  independent. With a cache (the W-1 = kernel-1 inputs before the chunk), taps before the
  chunk read the cache instead, so a sequence fed in chunks gives the same outputs as fed
  at once (`ops.conv.short_conv`, which also picks the context-parallel path).
  """

  def __init__(self, channels: int, kernel: int, *, rngs: nnx.Rngs):
    self.kernel = kernel
    w = jax.random.normal(rngs.params(), (kernel, channels), jnp.float32) * kernel ** -0.5
    self.weight = nnx.Param(w)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, *,
               cache: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Convolve x [B, T, C] -> (y [B, T, C] in x's dtype, new cache or None).

    Args:
      x: [B, T, C] inputs.
      segment_ids: [B, T] int32 or None. Without a cache: packed-document ids (taps never
        cross a change of id). With a cache: > 0 marks the chunk's real tokens, 0 padding;
        the real tokens must be a prefix of each row.
      cache: None, or [B, W-1, C] the inputs before the chunk (zeros at a sequence start).
    Returns:
      (y, None) without a cache; with one, (y, [B, W-1, C] the last W-1 inputs up to each
      row's last real token, in the cache's dtype).
    """
    w = self.weight[...]
    lag = self.kernel - 1
    b, t, _ = x.shape
    if cache is None:
      return short_conv(x, w, segment_ids=segment_ids), None
    if cache.shape != (b, lag) + x.shape[2:]:
      raise ValueError(f"conv cache has shape {cache.shape}, expected {(b, lag) + x.shape[2:]}")
    y = short_conv(x, w, history=cache)
    n_valid = (jnp.full((b,), t, jnp.int32) if segment_ids is None
               else jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32))
    # Row b's new tail is full[b, n_valid[b] : n_valid[b] + W-1]: it ends at its last real token.
    full = jnp.concatenate([cache.astype(x.dtype), x], axis=1)
    idx = n_valid[:, None] + jnp.arange(lag)[None, :]
    tail = jnp.take_along_axis(full, idx[..., None], axis=1)
    return y, tail.astype(cache.dtype)
