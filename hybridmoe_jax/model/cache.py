"""The decoder's decode cache: one pytree per layer, fixed shapes, per-row lengths.

Conventions: B batch, N cache capacity (max_len tokens), H q/k heads, HV value heads, K/V
key/value head dims, W conv_size, d_c the MLA latent (kv_lora_rank), Dr the rope-slot dim.
    KDACache  q_tail, k_tail [B, W-1, H*K], v_tail [B, W-1, HV*V] (compute dtype; the last
              W-1 conv inputs) and state [B, HV, K, V] float32: constant in N.
    MLACache  c [B, N, d_c] and k_r [B, N, Dr] (compute dtype): grows with N by
              (d_c + Dr) * itemsize bytes per token per layer.
    DecodeCache.length int32 [B]: tokens written so far in each row (rows may differ).
AttnRes needs nothing: the depth mix of a token reads only that token's block sums.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.layers.kda import KDACache
from hybridmoe_jax.layers.mla import MLACache


class DecodeCache(NamedTuple):
  layers: tuple       # one KDACache / MLACache per decoder layer
  length: jax.Array   # int32 [B]: positions 0..length[b]-1 of row b are filled

  @property
  def batch(self) -> int:
    return self.length.shape[0]

  @property
  def max_len(self) -> int:
    """Capacity N (a model without MLA layers has no positional cache: unbounded)."""
    for layer in self.layers:
      if isinstance(layer, MLACache):
        return layer.c.shape[1]
    return np.iinfo(np.int32).max


def init_cache(cfg: ModelConfig, batch: int, max_len: int, *, dtype: str = "float32"
               ) -> DecodeCache:
  """Empty cache for `batch` rows of up to `max_len` tokens; dtype: the compute dtype."""
  if batch < 1 or max_len < 1:
    raise ValueError(f"init_cache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}")
  layers = tuple(KDACache.zeros(cfg.kda, batch, dtype) if kind == "kda"
                 else MLACache.zeros(cfg.mla, batch, max_len, dtype)
                 for kind in cfg.layer_kinds)
  return DecodeCache(layers, jnp.zeros((batch,), jnp.int32))


def cache_bytes(cache: DecodeCache) -> dict[str, int]:
  """Allocated bytes: {"kda": ..., "mla": ..., "total": ...} (the lengths excluded)."""
  out = {"kda": 0, "mla": 0}
  for layer in cache.layers:
    kind = "kda" if isinstance(layer, KDACache) else "mla"
    out[kind] += sum(int(x.size) * x.dtype.itemsize for x in layer)
  out["total"] = out["kda"] + out["mla"]
  return out


def mla_bytes_per_token(cfg: ModelConfig, *, dtype: str = "float32") -> int:
  """(d_c + Dr) * MLA layers * itemsize: how much the cache grows per cached token."""
  n_mla = sum(kind == "mla" for kind in cfg.layer_kinds)
  return (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * n_mla * jnp.dtype(dtype).itemsize
