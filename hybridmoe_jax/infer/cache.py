"""Decode caches: one pytree per layer, fixed shapes, plus one position counter.

Conventions: B batch, N cache capacity (max_len tokens), H q/k heads, HV value heads, K/V
key/value head dims, d_c the MLA latent (kv_lora_rank), Dr the shared rope-slot key dim.
    KDACache  q_tail, k_tail [B, W-1, H*K], v_tail [B, W-1, HV*V] (compute dtype; the last
              W-1 conv inputs, W = conv_size) and state [B, HV, K, V] float32: constant in N.
    MLACache  c [B, N, d_c] and k_r [B, N, Dr] (compute dtype): grows with N by
              (d_c + Dr) * itemsize bytes per token per layer.
    DecodeCache.length int32 []: tokens written so far (the same for every row).
AttnRes needs nothing: the depth mix of a token reads only that token's block sums.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe_jax.config import ModelConfig


class KDACache(NamedTuple):
  q_tail: jax.Array   # [B, W-1, H*K]
  k_tail: jax.Array   # [B, W-1, H*K]
  v_tail: jax.Array   # [B, W-1, HV*V]
  state: jax.Array    # [B, HV, K, V] float32


class MLACache(NamedTuple):
  c: jax.Array        # [B, N, d_c]
  k_r: jax.Array      # [B, N, Dr]  (Dr may be 0)


LayerCache = Union[KDACache, MLACache]


class DecodeCache(NamedTuple):
  layers: tuple       # one KDACache / MLACache per decoder layer
  length: jax.Array   # int32 []: positions 0..length-1 are filled

  @property
  def batch(self) -> int:
    return jax.tree.leaves(self.layers)[0].shape[0]

  @property
  def max_len(self) -> int:
    """Capacity N (a model without MLA layers has no positional cache: unbounded)."""
    for layer in self.layers:
      if isinstance(layer, MLACache):
        return layer.c.shape[1]
    return np.iinfo(np.int32).max


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> DecodeCache:
  """Zero cache for `batch` rows and up to `max_len` tokens (compute-dtype activations)."""
  if batch < 1 or max_len < 1:
    raise ValueError(f"init_cache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}")
  dt = jnp.dtype(cfg.dtype)
  layers = []
  for kind in cfg.layer_kinds:
    if kind == "kda":
      k = cfg.kda
      w = k.conv_size - 1
      layers.append(KDACache(
          q_tail=jnp.zeros((batch, w, k.num_heads * k.head_dim), dt),
          k_tail=jnp.zeros((batch, w, k.num_heads * k.head_dim), dt),
          v_tail=jnp.zeros((batch, w, k.num_v_heads * k.v_head_dim), dt),
          state=jnp.zeros((batch, k.num_v_heads, k.head_dim, k.v_head_dim), jnp.float32)))
    else:
      m = cfg.mla
      layers.append(MLACache(c=jnp.zeros((batch, max_len, m.kv_lora_rank), dt),
                             k_r=jnp.zeros((batch, max_len, m.qk_rope_head_dim), dt)))
  return DecodeCache(tuple(layers), jnp.zeros((), jnp.int32))


def cache_bytes(cache: DecodeCache) -> dict[str, int]:
  """Allocated bytes: {"kda": ..., "mla": ..., "total": ...} (the counter excluded)."""
  out = {"kda": 0, "mla": 0}
  for layer in cache.layers:
    kind = "kda" if isinstance(layer, KDACache) else "mla"
    out[kind] += sum(int(x.size) * x.dtype.itemsize for x in layer)
  out["total"] = out["kda"] + out["mla"]
  return out


def mla_bytes_per_token(cfg: ModelConfig) -> int:
  """(d_c + Dr) * MLA layers * itemsize: how much the cache grows per cached token."""
  n_mla = sum(kind == "mla" for kind in cfg.layer_kinds)
  return (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * n_mla * jnp.dtype(cfg.dtype).itemsize
