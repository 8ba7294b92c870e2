"""The cudnn core: `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`.

Its public signature has no segment ids: packed documents could only be a dense
[B, 1, T, T] mask (O(T^2) memory, the very thing a flash kernel avoids), so it takes
unpacked input only. It needs q, k, v of one head dim: the wrapper zero-pads D and Dv to a
common multiple of 8 (zero columns change no logit) and slices the output.
"""

from __future__ import annotations

import jax

from .reference import check_self, pad_axis, round_up

CUDNN_NO_SEGMENTS = ("cudnn cannot take packed segment ids: jax.nn.dot_product_attention has "
                     "no segment argument, and a dense [B, 1, T, T] mask costs O(T^2) memory")


def cudnn_head_dim(head_dim: int, v_head_dim: int) -> int:
  """The one head dim the cuDNN call sees: max(D, Dv) rounded up to a multiple of 8."""
  return round_up(max(head_dim, v_head_dim), 8)


def cudnn_max_head_dim(compute_capability: str | None) -> int:
  """cuDNN flash attention's head-dim limit: 256 from Hopper (sm 9.0) on, else 128
  (unknown capability: the lower one)."""
  if compute_capability is None:
    return 128
  major = int(compute_capability.split(".")[0])
  return 256 if major >= 9 else 128


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    segment_ids: jax.Array | None = None, scale: float | None = None,
                    implementation: str = "cudnn") -> jax.Array:
  """Causal attention through `jax.nn.dot_product_attention` (cuDNN flash attention).

  Args:
    q [B, T, H, D], k [B, T, Hk, D], v [B, T, Hk, Dv]: as in the module docstring.
    segment_ids: must be None (see the module docstring).
    scale: logit scale, default D**-0.5.
    implementation: "cudnn"; "xla" runs the same call through XLA (checks the argument
      mapping on machines without cuDNN).
  Returns:
    [B, T, H, Dv] in v's dtype.
  """
  check_self(q, k, v, segment_ids)
  if segment_ids is not None:
    raise NotImplementedError(CUDNN_NO_SEGMENTS)
  d, dv = q.shape[-1], v.shape[-1]
  width = cudnn_head_dim(d, dv)
  q, k, v = (pad_axis(x, 3, width) for x in (q, k, v))
  o = jax.nn.dot_product_attention(q, k, v, scale=d ** -0.5 if scale is None else scale,
                                   is_causal=True, implementation=implementation)
  return o[..., :dv].astype(v.dtype)
