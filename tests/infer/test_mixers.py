"""Cached mixers in isolation: conv tails, absorbed vs expanded MLA, one model variant."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridmoe_jax.infer import Engine, init_cache
from hybridmoe_jax.infer.cache import MLACache
from hybridmoe_jax.infer.mixers import conv_with_tail, mla_chunk
from hybridmoe_jax.layers.conv import ShortConv
from hybridmoe_jax.model import HybridLM
from tests.infer.helpers import full_logits, random_tokens, tiny_cfg, tiny_model


def test_conv_with_tail_equals_short_conv():
  conv = ShortConv(6, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(6), (2, 11, 6))
  tail, outs = jnp.zeros((2, 3, 6)), []
  for s, n in ((0, 5), (5, 1), (6, 5)):       # the middle chunk is 1 real + 4 padding rows
    part = jnp.pad(x[:, s:s + n], ((0, 0), (0, 5 - n), (0, 0)))
    y, tail = conv_with_tail(conv.weight[...], part, tail, jnp.int32(n))
    outs.append(y[:, :n])
  np.testing.assert_allclose(jnp.concatenate(outs, 1), conv(x), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(tail, x[:, -3:])


def test_absorbed_mla_equals_expanded_and_training_form():
  model = tiny_model()
  layer, cfg = model.layers[3].mixer, model.cfg
  x = jax.random.normal(jax.random.PRNGKey(4), (2, 21, cfg.d_model))
  cache = init_cache(cfg, 2, 32).layers[3]
  assert isinstance(cache, MLACache)
  # Whole sequence from an empty cache, blocks of 5 keys == the training forward.
  y_abs, c1 = mla_chunk(layer, x, cache, jnp.int32(0), jnp.int32(21), kv_block=5)
  np.testing.assert_allclose(y_abs, layer(x), rtol=1e-5, atol=1e-5)
  # A chunk on top of a filled cache, last 3 rows padding: absorbed == expanded.
  x2 = jax.random.normal(jax.random.PRNGKey(5), (2, 8, cfg.d_model))
  a, ca = mla_chunk(layer, x2, c1, jnp.int32(21), jnp.int32(5), kv_block=4)
  e, ce = mla_chunk(layer, x2, c1, jnp.int32(21), jnp.int32(5), absorbed=False)
  np.testing.assert_allclose(a[:, :5], e[:, :5], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ca.c, ce.c)
  assert not np.any(np.asarray(ca.c[:, 26:]))  # padding rows were not written


def test_variant_without_attnres_rope_slot_with_qlora():
  base = tiny_cfg()
  cfg = tiny_cfg(num_layers=2, layer_kinds=("mla", "kda"),
                 attnres={"enabled": False, "block_size": 2},
                 mla={**base.mla.__dict__, "q_lora_rank": 16, "qk_rope_head_dim": 0},
                 kda={**base.kda.__dict__, "gate": "unbounded", "conv_size": 3})
  model = HybridLM(cfg, rngs=nnx.Rngs(3))
  tokens = random_tokens(3, 1, 30)
  ref = np.asarray(full_logits(model, tokens))
  engine = Engine(model, max_len=30, prefill_chunk=4, kv_block=4)
  last, cache = engine.prefill(tokens[:, :11])
  steps = [last]
  for t in range(11, 29):
    logits, cache = engine.decode_step(tokens[:, t], cache)
    steps.append(logits)
  got = np.asarray(jnp.stack(steps, 1))
  assert np.max(np.abs(got - ref[:, 10:29])) / np.max(np.abs(ref)) < 1e-4
