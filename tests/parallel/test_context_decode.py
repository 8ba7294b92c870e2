"""Context-parallel prefill and decode on 4 simulated CPU devices: the sharded engine ==
the single-device Engine (logits, every cache tensor, greedy tokens); the decode step's
collectives do not grow with the prompt."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from hybridmoe_jax.config import ComputeConfig
from hybridmoe_jax.infer import engine as engine_lib
from hybridmoe_jax.infer import steps
from hybridmoe_jax.infer.context_engine import ContextParallelEngine
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.ops.kda import kda
from hybridmoe_jax.parallel.context import CONTEXT_AXIS
from hybridmoe_jax.parallel.context_decode import ContextDecode, kda_continue_shard
from hybridmoe_jax.parallel.mesh import build_mesh
from tests._support import mini_model_config, rel_err
from tests.parallel.helpers import collective_bytes

N = 4                         # context shards
LENGTHS = (37, 30)            # ragged rows, neither a multiple of N: padded to 40 (10 a shard)
T = max(LENGTHS)
MAX_LEN = 48                  # 12 slots a shard
KV_BLOCK = 4                  # several blocks per shard
STEPS = 8


@pytest.fixture(scope="module")
def mesh():
  return build_mesh({CONTEXT_AXIS: N}, devices=jax.devices()[:N])


@pytest.fixture(scope="module")
def model():
  """KDA then MLA, each followed by the MoE (2 of 4 experts per token)."""
  cfg = mini_model_config(num_experts=4, experts_per_token=2)
  cfg = dataclasses.replace(cfg, layer_kinds=("kda", "mla"),
                            moe=dataclasses.replace(cfg.moe, first_dense_layers=0))
  return HybridLM(cfg, rngs=nnx.Rngs(0), compute=ComputeConfig(kda_chunk_size=16))


@pytest.fixture(scope="module")
def prompt():
  tokens = np.random.default_rng(0).integers(1, 64, (2, T)).astype(np.int32)
  return tokens, np.asarray(LENGTHS, np.int32)


@pytest.fixture(scope="module")
def engines(model, mesh):
  return (engine_lib.Engine(model, max_len=MAX_LEN, prefill_chunk=64, kv_block=KV_BLOCK),
          ContextParallelEngine(model, mesh, max_len=MAX_LEN, kv_block=KV_BLOCK))


def _positions(filled_history, n_loc):
  """Sharded slot -> sequence position per row, replaying the layout: the prompt's shard r
  holds positions [r t, (r + 1) t) in its first slots; each decoded token goes to the first
  least-filled shard. filled_history: [filled after prefill, ...] ([B, N] each)."""
  b = filled_history[0].shape[0]
  pos = np.full((b, N * n_loc), -1)
  t_loc = -(-T // N)
  for row in range(b):
    filled = filled_history[0][row].copy()
    for r in range(N):
      pos[row, r * n_loc:r * n_loc + filled[r]] = r * t_loc + np.arange(filled[r])
    nxt = LENGTHS[row]
    for later in filled_history[1:]:
      r = int(np.argmin(filled))
      pos[row, r * n_loc + filled[r]] = nxt
      filled[r] += 1
      nxt += 1
      np.testing.assert_array_equal(filled, later[row])
  return pos


def _check_caches(got, want, filled_history):
  """Every tensor of the sharded cache == the single-device cache at the same positions."""
  np.testing.assert_array_equal(got.length, want.length)
  for g, w in zip(got.layers, want.layers):
    if hasattr(g, "filled"):
      b, n_all, d_c = g.c.shape                # each device holds N_loc = n_all / N slots
      assert g.c.sharding.shard_shape(g.c.shape) == (b, n_all // N, d_c), g.c.sharding
      pos = _positions(filled_history, g.c.shape[1] // N)
      for name in ("c", "k_r"):
        gv, wv = np.asarray(getattr(g, name)), np.asarray(getattr(w, name))
        for row in range(pos.shape[0]):
          used = pos[row] >= 0
          assert used.sum() == int(want.length[row])
          assert rel_err(gv[row, used], wv[row, pos[row, used]]) < 1e-5, name
    else:
      for name, gv, wv in zip(g._fields, g, w):
        assert rel_err(gv, wv) < 1e-5, name


def test_prefill_and_decode_equal_one_device(engines, prompt):
  """Ragged prompts (37 and 30 tokens: the last shard part padding, resp. empty): the last
  logits and every cache tensor, then 8 greedy steps' logits and caches, == one device."""
  ref, cp = engines
  tokens, lengths = prompt
  want, ref_cache = ref.prefill(tokens, lengths=lengths)
  got, cache = cp.prefill(tokens, lengths=lengths)
  assert rel_err(got, want) < 1e-5
  mla = next(layer for layer in cache.layers if hasattr(layer, "filled"))
  history = [np.asarray(mla.filled)]
  np.testing.assert_array_equal(history[0], [[10, 10, 10, 7], [10, 10, 10, 0]])
  _check_caches(cache, ref_cache, history)
  token = np.argmax(np.asarray(want), -1)
  for _ in range(STEPS):
    want, ref_cache = ref.decode_step(token, ref_cache)
    got, cache = cp.decode_step(token, cache)
    assert rel_err(got, want) < 1e-5
    mla = next(layer for layer in cache.layers if hasattr(layer, "filled"))
    history.append(np.asarray(mla.filled))
    token = np.argmax(np.asarray(want), -1)
  _check_caches(cache, ref_cache, history)


@pytest.mark.slow
def test_greedy_generate_equals_one_device(engines, prompt):
  ref, cp = engines
  tokens, lengths = prompt
  want = ref.generate(tokens, max_new_tokens=STEPS, prompt_lengths=lengths)
  got = cp.generate(tokens, max_new_tokens=STEPS, prompt_lengths=lengths)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)


@pytest.mark.slow
def test_score_equals_one_device(engines, prompt):
  ref, cp = engines
  tokens = prompt[0]
  want, got = ref.score(tokens), cp.score(tokens)
  assert rel_err(got[0], want[0]) < 1e-5
  np.testing.assert_array_equal(got[1], want[1])


def test_decode_collectives_do_not_grow_with_the_prompt(model, mesh):
  """The compiled decode step at 64 and 1024 cached tokens a row: the same collectives with
  the same bytes (one pmax and two psums of [B, 1, H(, d_c)] fp32 per MLA layer), and no
  all-gather of the cache."""
  def hlo(max_len):
    cp = ContextParallelEngine(model, mesh, max_len=max_len, kv_block=KV_BLOCK)
    with cp.placement():
      return steps._decode_step.lower(cp.graphdef, cp.state, jnp.zeros((2,), jnp.int32),
                                           cp.init_cache(2), kv_block=KV_BLOCK
                                           ).compile().as_text()

  short, long = collective_bytes(hlo(64)), collective_bytes(hlo(1024))
  assert short == long, (short, long)
  mla = model.cfg.mla
  assert set(short) == {"all-reduce"}, short
  assert short["all-reduce"] <= 2 * mla.num_heads * (mla.kv_lora_rank + 2) * 4, short


def test_kda_continue_shard_from_a_state(mesh):
  """The sharded KDA from a nonzero state: outputs and final state == one device."""
  rng = np.random.default_rng(1)
  b, t, hv, k = 1, N * 24, 1, 8     # 24 tokens a shard, chunk 16: chunks cross shards
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  q, kk = (f32(unit(rng.standard_normal((b, t, hv, k)))) for _ in range(2))
  v = f32(rng.standard_normal((b, t, hv, k)))
  g = f32(-3.0 * jax.nn.sigmoid(rng.standard_normal((b, t, hv, k))))
  beta = f32(jax.nn.sigmoid(rng.standard_normal((b, t, hv))))
  s0 = f32(rng.standard_normal((b, hv, k, k)))
  opts = dict(chunk_size=16, impl="chunked")
  want_o, want_s = kda(q, kk, v, g, beta, initial_state=s0, output_final_state=True, **opts)
  seq = P(None, CONTEXT_AXIS)
  run = jax.jit(jax.shard_map(
      lambda *a: kda_continue_shard(*a[:5], initial_state=a[5], **opts), mesh=mesh,
      in_specs=(seq,) * 5 + (P(),), out_specs=(seq, P()), check_vma=False))
  got_o, got_s = run(q, kk, v, g, beta, s0)
  assert rel_err(got_o, want_o) < 1e-5
  assert rel_err(got_s, want_s) < 1e-5


def test_bad_inputs_raise_naming_the_field(engines, mesh, model):
  _, cp = engines
  tokens = np.ones((2, 8), np.int32)
  with pytest.raises(ValueError, match="cache"):
    cp.prefill(tokens, cache=cp.init_cache(2))
  with pytest.raises(ValueError, match="max_len=48"):
    cp.prefill(np.ones((1, 49), np.int32))
  with pytest.raises(ValueError, match="no 'context' axis"):
    ContextParallelEngine(model, jax.make_mesh((1,), ("data",), devices=jax.devices()[:1]),
                          max_len=8)
  with pytest.raises(NotImplementedError, match="images"):
    cp.prefill(tokens, images={})
  layer = next(layer for layer in cp.init_cache(1).layers if hasattr(layer, "filled"))
  q = jnp.zeros((1, 6, 1, 12))
  with pytest.raises(ValueError, match="mesh.context=4"):
    ContextDecode(mesh).cached_latent_attention(q, q[:, :, 0, :8], q[:, :, 0, :4], layer,
                                                jnp.ones((1,), jnp.int32), scale=1.0,
                                                kv_block=4)


@pytest.mark.slow
def test_rows_over_data_and_prompt_over_context(engines, model, prompt):
  """8 devices, data=2 x context=4: each row on its own 4 devices; prefill and two decode
  steps == one device."""
  ref = engines[0]
  cp = ContextParallelEngine(model, build_mesh({"data": 2, CONTEXT_AXIS: N}),
                             max_len=MAX_LEN, kv_block=KV_BLOCK)
  tokens, lengths = prompt
  want, ref_cache = ref.prefill(tokens, lengths=lengths)
  got, cache = cp.prefill(tokens, lengths=lengths)
  assert rel_err(got, want) < 1e-5
  mla = next(layer for layer in cache.layers if hasattr(layer, "filled"))
  assert mla.c.sharding.shard_shape(mla.c.shape) == (1, MAX_LEN // N, mla.c.shape[2])
  token = np.argmax(np.asarray(want), -1)
  for _ in range(2):
    want, ref_cache = ref.decode_step(token, ref_cache)
    got, cache = cp.decode_step(token, cache)
    assert rel_err(got, want) < 1e-5
    token = np.argmax(np.asarray(want), -1)
