"""Short causal depthwise convolution that never reads across packed documents."""

import jax
import jax.numpy as jnp

from .plan import current_plan, run_local


def short_conv(x: jax.Array, w: jax.Array, *, segment_ids: jax.Array | None = None,
               history: jax.Array | None = None, history_ids: jax.Array | None = None
               ) -> jax.Array:
  """y_t = SiLU(sum_j w[j] * x_{t-j}) over taps j < W, per channel.

  Dispatch: without `history` under a plan with a context runner, the whole sequence runs
  shard by shard (`plan.context.short_conv`, each shard reading its left halo); else here.

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
  plan = current_plan()
  if history is None and plan.context is not None:
    return run_local(plan.context.short_conv, x, w, segment_ids=segment_ids)
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
