"""The splash core: TPU splash attention.

Causal mask + segment ids, MQA form for one shared head (Hk = 1, the absorbed MLA), grouped
form otherwise; tiles of 128 n tokens (T padded at the end); no logit scale argument, so q
is scaled first. The Pallas module is imported at use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import check_self, pad_axis, round_up

SPLASH_TILE = 128           # splash tiles are multiples of the TPU's 128 lanes


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     segment_ids: jax.Array | None = None, scale: float | None = None,
                     block: int = 128, interpret: bool = False) -> jax.Array:
  """Causal attention by TPU splash attention (forward and backward kernels).

  Args:
    q [B, T, H, D], k [B, T, Hk, D], v [B, T, Hk, Dv], segment_ids [B, T] or None.
    scale: logit scale, default D**-0.5 (applied to q: splash takes no scale).
    block: tile tokens, rounded up to a multiple of 128 and capped at what T needs; T is
      padded to a multiple of it.
    interpret: run the kernel in Pallas' interpreter (any backend; tests).
  Returns:
    [B, T, H, Dv] in v's dtype; differentiable in q, k, v.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # lazy
      splash_attention_kernel as splash, splash_attention_mask as masks)

  check_self(q, k, v, segment_ids)
  b, t, h, d = q.shape
  hk = k.shape[2]
  tile = min(round_up(max(block, 1), SPLASH_TILE), round_up(t, SPLASH_TILE))
  tp = round_up(t, tile)
  q = (q * (d ** -0.5 if scale is None else scale)).astype(q.dtype)
  q, k, v = (jnp.moveaxis(pad_axis(x, 1, tp), 2, 1) for x in (q, k, v))  # [B, heads, T, .]
  mask = masks.MultiHeadMask([masks.CausalMask((tp, tp))] * h)
  tiles = splash.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile,
                            block_q_dkv=tile, block_kv_dkv=tile, block_kv_dkv_compute=tile,
                            block_q_dq=tile, block_kv_dq=tile)
  make = splash.make_splash_mqa if hk == 1 else splash.make_splash_mha
  kernel = make(mask, block_sizes=tiles, head_shards=1, q_seq_shards=1, interpret=interpret)
  if hk == 1:  # MQA: one [T, D] key / value head shared by all query heads
    k, v = k[:, 0], v[:, 0]
  if segment_ids is None:
    o = jax.vmap(kernel)(q, k, v)
  else:
    seg = pad_axis(segment_ids.astype(jnp.int32), 1, tp, -1)
    o = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(
        q, k, v, seg)
  return jnp.moveaxis(o, 1, 2)[:, :t].astype(v.dtype)
