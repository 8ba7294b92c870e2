"""Context parallelism on 4 simulated CPU devices: each sharded op == the single-device op,
forward and gradients; KDA's cross-shard bytes do not grow with T."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from hybridmoe_jax.config import ComputeConfig
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.ops.blockwise_attention import attention_reference
from hybridmoe_jax.ops.kda import kda
from hybridmoe_jax.parallel.context import (CONTEXT_AXIS, ContextParallel, kda_shard,
                                            latent_attention_shard, previous_tokens)
from hybridmoe_jax.parallel.ep_moe import ExpertParallelDispatch
from hybridmoe_jax.parallel.mesh import batch_sharding
from tests.parallel.helpers import make_mesh
from tests.train.train_fakes import tiny_model_config

N = 4                                   # context shards
SEQ = P(None, CONTEXT_AXIS)             # [B, T, ...] split along T
B, T = 2, N * 24                        # 24 tokens per shard, chunk 16: chunks cross shards


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), (CONTEXT_AXIS,), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:N])


def _sharded(mesh, body, n_in):
  return jax.shard_map(body, mesh=mesh, in_specs=(SEQ,) * n_in, out_specs=SEQ,
                       check_vma=False)


def _segments():
  """Row 0: documents end inside shards 1 and 2 (the state carries across the 0|1 and 2|3
  boundaries); row 1: a document starts exactly at the 0|1 boundary (the carry is dropped)
  and one ends inside shard 2; the last 3 tokens are padding (id 0)."""
  seg = np.ones((B, T), np.int32)
  seg[0, 30:], seg[0, 52:] = 2, 3
  seg[1, 24:], seg[1, 70:] = 2, 3
  seg[:, T - 3:] = 0
  return jnp.asarray(seg)


def _kda_inputs(seed, h=1, hv=2, k=16, v=16):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return (f32(unit(rng.standard_normal((B, T, h, k)))),
          f32(unit(rng.standard_normal((B, T, h, k)))),
          f32(rng.standard_normal((B, T, hv, v))),
          f32(-5.0 * jax.nn.sigmoid(rng.standard_normal((B, T, hv, k)))),
          f32(jax.nn.sigmoid(rng.standard_normal((B, T, hv)))),
          f32(rng.standard_normal((B, T, hv, v))))


def _max_rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def _check_value_and_grads(single, sharded, args, w):
  want = single(*args)
  got = jax.jit(sharded)(*args)
  assert _max_rel(got, want) < 1e-5
  argnums = tuple(range(len(args)))
  g_want = jax.grad(lambda *a: jnp.sum(single(*a) * w), argnums)(*args)
  g_got = jax.jit(jax.grad(lambda *a: jnp.sum(sharded(*a) * w), argnums))(*args)
  for i, (a, r) in enumerate(zip(g_got, g_want)):
    assert _max_rel(a, r) < 1e-5, f"gradient of argument {i}"


# Unpacked: the packed case covers it (one document per row is a special case); slow.
@pytest.mark.parametrize("packed", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_kda_shards_equal_one_device(mesh, packed):
  *args, w = _kda_inputs(0)
  seg = _segments() if packed else None
  opts = dict(chunk_size=16, lower_bound=-5.0)
  single = lambda *a: kda(*a, segment_ids=seg, impl="chunked", **opts)[0]
  if packed:
    body = lambda q, k, v, g, b, s: kda_shard(q, k, v, g, b, segment_ids=s, **opts)
    sharded = lambda *a: _sharded(mesh, body, 6)(*a, seg)
  else:
    sharded = _sharded(mesh, lambda *a: kda_shard(*a, **opts), 5)
  _check_value_and_grads(single, sharded, args, w)


def test_latent_attention_shards_equal_one_device(mesh):
  rng = np.random.default_rng(1)
  d_c, d_r, heads = 16, 4, 3
  f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, c, k_r, w = f32(B, T, heads, d_c + d_r), f32(B, T, d_c), f32(B, T, d_r), f32(B, T, heads, d_c)
  seg = _segments()

  def single(q, c, k_r):
    keys = jnp.concatenate([c, k_r], -1)[:, :, None]
    return attention_reference(q, keys, c[:, :, None], q_segment_ids=seg, kv_segment_ids=seg,
                               scale=0.3)

  body = lambda q, c, k_r, s: latent_attention_shard(q, c, k_r, segment_ids=s, scale=0.3,
                                                     block=8)
  _check_value_and_grads(single, lambda *a: _sharded(mesh, body, 4)(*a, seg), (q, c, k_r), w)


def test_previous_tokens_is_the_left_halo(mesh):
  x = jnp.arange(B * T * 2, dtype=jnp.float32).reshape(B, T, 2)
  halo = _sharded(mesh, lambda x: previous_tokens(x, 3), 1)(x)          # [B, N * 3, 2]
  halo = np.asarray(halo).reshape(B, N, 3, 2)
  np.testing.assert_array_equal(halo[:, 0], 0.0)                       # shard 0: no left side
  for r in range(1, N):
    np.testing.assert_array_equal(halo[:, r], np.asarray(x)[:, r * 24 - 3:r * 24])


_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter|collective-permute|"
                         r"all-to-all)(?:-start)?\(")
_ARRAY = re.compile(r"\b(f32|f16|bf16|s32|u32|pred|s8|u8)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "pred": 1, "s8": 1, "u8": 1}


def _collective_bytes(hlo: str) -> dict[str, int]:
  """Result bytes per collective kind in compiled HLO text."""
  out = {}
  for m in _COLLECTIVE.finditer(hlo):
    size = sum(_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d]))
               for dt, dims in _ARRAY.findall(m.group(1)))
    out[m.group(2)] = out.get(m.group(2), 0) + size
  return out


def test_kda_cross_shard_bytes_do_not_grow_with_length(mesh):
  """Forward and backward of the sharded KDA at T = 2K and 8K tokens: the same collectives
  with the same bytes (the (A, B) maps and the boundary ids, not the sequence)."""
  def hlo(t):
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    args = (sd(1, t, 1, 16), sd(1, t, 1, 16), sd(1, t, 1, 16), sd(1, t, 1, 16), sd(1, t, 1),
            jax.ShapeDtypeStruct((1, t), jnp.int32))
    body = lambda q, k, v, g, b, s: kda_shard(q, k, v, g, b, segment_ids=s, chunk_size=16,
                                              lower_bound=-5.0)
    f = _sharded(mesh, body, 6)
    loss = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2, 3, 4))
    return jax.jit(loss).lower(*args).compile().as_text()

  short, long = _collective_bytes(hlo(2048)), _collective_bytes(hlo(8192))
  assert short and "all-gather" in short, short
  assert short == long, (short, long)
  # The maps: N shards x [1, 1, 16, 16 + 16] fp32, far below one shard's activations.
  assert short["all-gather"] < 4 * 1 * 16 * 32 * 4 * 2, short


# --------------------------------------------------------------------------- whole model
def _hybrid_config():
  """KDA then MLA, each followed by the MoE (experts exercised), packed documents."""
  cfg = tiny_model_config(num_experts=4, experts_per_token=2)
  return dataclasses.replace(cfg, layer_kinds=("kda", "mla"),
                             moe=dataclasses.replace(cfg.moe, first_dense_layers=0))


def _tokens_and_segments():
  rng = np.random.default_rng(2)
  return jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32), _segments()


def _logits_and_grads(model, tokens, seg):
  def loss(model):
    logits, _ = model(tokens, segment_ids=seg)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * (seg > 0)), logits

  (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  return logits, nnx.to_pure_dict(grads)


# data x context is slow: expert x context runs the same sharded mixers plus the EP MoE.
@pytest.mark.parametrize("sizes", [pytest.param(dict(data=2, context=4), marks=pytest.mark.slow),
                                   dict(expert=2, context=4)])
def test_whole_model_logits_and_gradients_equal_one_device(sizes):
  """HybridLM with its KDA and MLA layers sequence-sharded (and, in the second case, its
  experts over `expert`): logits and every parameter gradient == the plain model's."""
  cfg = _hybrid_config()
  compute = ComputeConfig(kda_chunk_size=16)
  tokens, seg = _tokens_and_segments()
  want = _logits_and_grads(HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute), tokens, seg)
  mesh = make_mesh(**sizes)
  dispatch = ExpertParallelDispatch(mesh) if sizes.get("expert", 1) > 1 else None
  model = HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute, moe_dispatch=dispatch,
                   context=ContextParallel(mesh, block=8))
  placed = [jax.device_put(x, batch_sharding(mesh, sequence=True)) for x in (tokens, seg)]
  with jax.set_mesh(mesh):
    got = nnx.jit(_logits_and_grads)(model, *placed)
  assert _max_rel(got[0], want[0]) < 1e-5
  flat_got = dict(jax.tree_util.tree_flatten_with_path(got[1])[0])
  flat_want = jax.tree_util.tree_flatten_with_path(want[1])[0]
  assert len(flat_got) == len(flat_want)
  for path, w in flat_want:
    assert _max_rel(flat_got[path], w) < 1e-5, jax.tree_util.keystr(path)
