"""The cached forward (prefill chunks, single-token decode, ragged rows) == the training
forward of the same model, fp32: KDA and MLA layers, AttnRes on and off, grouped heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ComputeConfig
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.cache import init_cache
from tests._support import rel_err, tiny_model_config

COMPUTE = ComputeConfig(kda_impl="chunked", kda_chunk_size=16)


VARIANTS = {
    "tiny": {},   # 3 KDA + 1 MLA (rope slot), AttnRes, MoE
    "plain_grouped": {
        "num_layers": 3, "layer_kinds": ("kda", "mla", "kda"),
        "attnres": {"enabled": False, "block_size": 2},
        "kda": {"num_heads": 1, "num_v_heads": 2, "gate": "unbounded", "conv_size": 3},
        "mla": {"q_lora_rank": 16, "qk_rope_head_dim": 0}},
}


@nnx.jit
def _full(model, tokens, segment_ids):
  return model(tokens, segment_ids=segment_ids)[0]


@nnx.jit
def _chunk(model, tokens, segment_ids, cache):
  logits, aux = model(tokens, segment_ids=segment_ids, cache=cache, kv_block=4)
  return logits, aux["cache"], aux["moe"]


def _feed(model, cache, tokens, n_valid, width):
  """One chunk of `width` tokens per row, the first n_valid [B] of `tokens` [B, n] real."""
  tokens = jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
  seg = (jnp.arange(width)[None] < jnp.asarray(n_valid)[:, None]).astype(jnp.int32)
  return _chunk(model, tokens, seg, cache)


def _tokens(seed, b, t):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, 256)


# plain_grouped is slow; by default its parts are covered by
# tests/infer/test_decode.py::test_variant_without_attnres_rope_slot_with_qlora (a model
# without AttnRes, q_lora, no rope slot, unbounded gate, conv 3: partial prefill chunks then
# decode == forward) and tests/layers/test_mixers.py::test_cached_pieces_equal_training_
# forward[kda-kw3] (grouped heads 1:4, conv 3), [mla-kw5] (q_lora), [mla-kw6] (no rope):
# cached pieces with padding == the training forward.
@pytest.mark.parametrize("variant", [
    "tiny", pytest.param("plain_grouped", marks=pytest.mark.slow)])
def test_chunked_prefill_and_decode_equal_full_forward(variant):
  """22 tokens fed as 7 (of a chunk of 8), 8, then 1, 1 token steps, then 5 (of 8): chunks
  end inside the document and inside a KDA chunk; every real position's logits match."""
  cfg = tiny_model_config(**VARIANTS[variant])
  model = HybridLM(cfg, rngs=nnx.Rngs(1), compute=COMPUTE)
  tokens = _tokens(2, 2, 22)
  ref = _full(model, tokens, jnp.ones_like(tokens))
  cache, outs, s = init_cache(cfg, 2, 24), [], 0
  for n, width in ((7, 8), (8, 8), (1, 1), (1, 1), (5, 8)):
    logits, cache, _ = _feed(model, cache, tokens[:, s:s + n], [n, n], width)
    outs.append(logits[:, :n])
    s += n
  assert cache.length.tolist() == [22, 22]
  assert rel_err(jnp.concatenate(outs, 1), ref) < 1e-5


def test_ragged_rows_equal_each_row_alone():
  """Prompts of 5 and 11 tokens in one cache (the second chunk is all padding for row 0),
  then one decode step per row: each row's logits == that row run alone."""
  cfg = tiny_model_config()
  model = HybridLM(cfg, rngs=nnx.Rngs(1), compute=COMPUTE)
  a, b = _tokens(3, 1, 6)[0], _tokens(4, 1, 12)[0]      # prompt + the decoded token
  cache = init_cache(cfg, 2, 24)   # the capacity of the test above: its compiled chunks serve
  first = jnp.stack([jnp.pad(a[:5], (0, 3)), b[:8]])
  l1, cache, stats = _feed(model, cache, first, [5, 8], 8)
  for layer in stats["layers"].values():   # padding is left out of the routing statistics
    assert int(layer["ffn"]["bias"]["load"].sum()) == 13 * cfg.moe.experts_per_token
  l2, cache, _ = _feed(model, cache, jnp.stack([jnp.zeros(3, a.dtype), b[8:11]]), [0, 3], 8)
  l3, cache, _ = _feed(model, cache, jnp.stack([a[5:6], b[11:12]]), [1, 1], 1)
  assert cache.length.tolist() == [6, 12]
  # Row a alone, right-padded to b's length (one compiled forward for both): causal, and
  # padding (id 0) is left out of routing, so its first 6 logits are a's alone
  ref_a = _full(model, jnp.pad(a, (0, 6))[None],
                (jnp.arange(12) < 6).astype(jnp.int32)[None])[0, :6]
  ref_b = _full(model, b[None], jnp.ones((1, 12), jnp.int32))[0]
  assert rel_err(jnp.concatenate([l1[0, :5], l3[0]]), ref_a) < 1e-5
  assert rel_err(jnp.concatenate([l1[1], l2[1, :3], l3[1]]), ref_b) < 1e-5


@nnx.jit
def _call(model, tokens, inputs_embeds=None, logits_at=None, cache=None):
  return model(tokens, inputs_embeds=inputs_embeds, logits_at=logits_at, cache=cache)[0]


def test_logits_at_and_inputs_embeds():
  """logits_at picks positions before the head; inputs_embeds replaces the embedding. Jitted
  (one program per call pattern); the bad calls raise while tracing, before any compile."""
  cfg = tiny_model_config()
  model = HybridLM(cfg, rngs=nnx.Rngs(1), compute=COMPUTE)
  tokens = _tokens(5, 2, 9)
  full = _call(model, tokens)
  at = jnp.array([[8, 0], [3, 3]])
  embeds = nnx.jit(lambda m, t: m.embed_inputs(t))(model, tokens)
  picked = _call(model, None, inputs_embeds=embeds, logits_at=at)
  np.testing.assert_allclose(picked, jnp.take_along_axis(full, at[..., None], 1),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="logits_at"):
    _call(model, tokens, logits_at=jnp.array([1, 2]))
  with pytest.raises(ValueError, match="inputs_embeds"):
    _call(model, tokens, inputs_embeds=embeds)
  with pytest.raises(ValueError, match="layers"):
    two = tiny_model_config(num_layers=2, layer_kinds=("kda", "mla"))
    _call(model, tokens, cache=init_cache(two, 2, 9))
