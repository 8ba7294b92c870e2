"""Cache sizes: KDA state constant in the context, MLA grows by exactly (d_c + Dr) per token."""

import jax.numpy as jnp
import pytest

from hybridmoe_jax.infer import cache_bytes, init_cache, mla_bytes_per_token
from tests._support import tiny_model_config


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_growth_is_exact(dtype):
  cfg = tiny_model_config()
  itemsize = jnp.dtype(dtype).itemsize
  per_token = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 1 * itemsize   # 1 MLA layer
  assert mla_bytes_per_token(cfg, dtype=dtype) == per_token == (32 + 8) * itemsize
  sizes = {n: cache_bytes(init_cache(cfg, 1, n, dtype=dtype)) for n in (1024, 4096, 65536)}
  k = cfg.kda
  kda_state = 3 * k.num_v_heads * k.head_dim * k.v_head_dim * 4           # fp32 states
  kda_tails = 3 * (k.conv_size - 1) * (2 * k.num_heads * k.head_dim
                                       + k.num_v_heads * k.v_head_dim) * itemsize
  for n, s in sizes.items():
    assert s["kda"] == kda_state + kda_tails                               # constant in n
    assert s["mla"] == n * per_token
  assert sizes[65536]["total"] - sizes[1024]["total"] == (65536 - 1024) * per_token


def test_all_kda_and_all_mla_models():
  kda_only = tiny_model_config(layer_kinds=("kda",) * 4)
  mla_only = tiny_model_config(layer_kinds=("mla",) * 4)
  assert cache_bytes(init_cache(kda_only, 2, 10))["mla"] == 0
  assert init_cache(kda_only, 2, 10).max_len > 2**30
  assert init_cache(kda_only, 2, 10).length.tolist() == [0, 0]   # one length per row
  assert mla_bytes_per_token(mla_only) == 4 * 40 * 4
  assert cache_bytes(init_cache(mla_only, 1, 100))["total"] == 100 * 4 * 40 * 4
  with pytest.raises(ValueError, match="max_len"):
    init_cache(mla_only, 1, 0)
