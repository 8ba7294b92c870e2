"""Short causal depthwise convolution that never reads across packed documents."""

import jax
import jax.numpy as jnp
from flax import nnx


def short_conv(x: jax.Array, w: jax.Array, *, segment_ids: jax.Array | None = None,
               history: jax.Array | None = None, history_ids: jax.Array | None = None
               ) -> jax.Array:
  """y_t = SiLU(sum_j w[j] * x_{t-j}) over taps j < W, per channel (the functional core).

  Args:
    x: [B, T, C] inputs.
    w: [W, C] fp32 taps.
    segment_ids: [B, T] int32 or None. Given: a tap reads x_{t-j} only where its id equals
      token t's id (packed documents stay independent). None: every tap is read.
    history: [B, W-1, C] the inputs just before x (None: zeros, a sequence start).
    history_ids: [B, W-1] int32 the ids of `history` (None: -1, matching no token).
  Returns:
    y [B, T, C] in x's dtype, the products summed in fp32.
  """
  lag = w.shape[0] - 1
  b, t = x.shape[:2]
  if history is None:
    history = jnp.zeros((b, lag) + x.shape[2:], x.dtype)
  full = jnp.concatenate([history.astype(x.dtype), x], axis=1).astype(jnp.float32)
  seg_full = None
  if segment_ids is not None:
    if history_ids is None:
      history_ids = jnp.full((b, lag), -1, segment_ids.dtype)
    seg_full = jnp.concatenate([history_ids.astype(segment_ids.dtype), segment_ids], axis=1)
  y = full[:, lag:] * w[0]
  for j in range(1, lag + 1):
    shifted = full[:, lag - j:lag - j + t]
    if seg_full is not None:
      shifted = jnp.where((seg_full[:, lag - j:lag - j + t] == segment_ids)[..., None],
                          shifted, 0.0)
    y = y + shifted * w[j]
  return jax.nn.silu(y).astype(x.dtype)


class ShortConv(nnx.Module):
  """y_t = SiLU(sum_j w[j] * x_{t-j}) over taps j < kernel, per channel, no bias.

  Weights [kernel, C] are fp32. Without a cache, taps reaching into an earlier segment
  (packed sequences) or before the start of the sequence read zeros, so documents stay
  independent. With a cache (the W-1 = kernel-1 inputs before the chunk), taps before the
  chunk read the cache instead, so a sequence fed in chunks gives the same outputs as fed
  at once. Built with a context-parallel runner (`parallel.context.ContextParallel`), the
  cache-free forward runs on sequence shards, each reading its left halo explicitly.
  """

  def __init__(self, channels: int, kernel: int, *, rngs: nnx.Rngs, context=None):
    self.kernel = kernel
    self.context = context
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
      if self.context is not None:
        return self.context.short_conv(x, w, segment_ids=segment_ids), None
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
