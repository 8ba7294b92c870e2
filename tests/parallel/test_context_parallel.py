"""Context parallelism on 4 simulated CPU devices: each sharded op == the single-device op,
forward and gradients, in the contiguous and the zigzag layout (shard r holds pieces r and
2n-1-r of 2n); KDA's cross-shard bytes do not grow with T."""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from hybridmoe_jax.config import ComputeConfig
from hybridmoe_jax.ops.conv import short_conv
from hybridmoe_jax.layers.moe import MoE
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.ops.attention.reference import attention_reference
from hybridmoe_jax.ops.kda import kda
from hybridmoe_jax.ops.plan import ExecutionPlan, execution_plan
from hybridmoe_jax.parallel.context import (CONTEXT_AXIS, ContextParallel, kda_shard,
                                            latent_attention_shard, piece_table,
                                            previous_tokens, short_conv_shard)
from hybridmoe_jax.parallel.ep_moe import ExpertParallelDispatch
from hybridmoe_jax.parallel.mesh import batch_sharding
from tests._support import mini_model_config, rel_err
from tests.parallel.helpers import HLO_ARRAY, collective_bytes, make_mesh

N = 4                                   # context shards
SEQ = P(None, CONTEXT_AXIS)             # [B, T, ...] split along T
B, T = 2, N * 24                        # 24 tokens per shard, chunk 16: chunks cross shards
LAYOUTS = [False, True]                 # zigzag off / on (pieces of 12 tokens)


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), (CONTEXT_AXIS,), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:N])


def _sharded(mesh, body, n_in, zigzag=False):
  """body over the layout: [B, T, ...] arguments in sequence order are put in the layout
  (a plain gather, the reference permutation), the result is put back in sequence order."""
  f = jax.shard_map(body, mesh=mesh, in_specs=(SEQ,) * n_in, out_specs=SEQ, check_vma=False)
  if not zigzag:
    return f
  perm = _layout_order(zigzag)
  return lambda *a: f(*(x[:, perm] for x in a))[:, np.argsort(perm)]


def _under(plan, fn):
  """fn traced under the execution plan `plan`."""
  def traced(*args, **kwargs):
    with execution_plan(plan):
      return fn(*args, **kwargs)
  return traced


def _layout_order(zigzag, n=N, t=T):
  """[T] int: the sequence position of each token of the layout (shard-major)."""
  table = piece_table(n, zigzag)
  size = t // table.size
  return np.concatenate([np.arange(p * size, (p + 1) * size) for p in table.reshape(-1)])


def _segments():
  """Row 0: documents end inside shards 1 and 2 (the state carries across the 0|1 and 2|3
  boundaries and across every zigzag piece boundary); row 1: a document starts exactly at
  the 0|1 boundary (the carry is dropped) and one at 60, inside shard 2 but a zigzag piece
  boundary (pieces of 12); the last 3 tokens are padding (id 0)."""
  seg = np.ones((B, T), np.int32)
  seg[0, 30:], seg[0, 52:] = 2, 3
  seg[1, 24:], seg[1, 60:] = 2, 3
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


def _check_value_and_grads(single, sharded, args, w):
  want = single(*args)
  got = jax.jit(sharded)(*args)
  assert rel_err(got, want) < 1e-5
  argnums = tuple(range(len(args)))
  g_want = jax.grad(lambda *a: jnp.sum(single(*a) * w), argnums)(*args)
  g_got = jax.jit(jax.grad(lambda *a: jnp.sum(sharded(*a) * w), argnums))(*args)
  for i, (a, r) in enumerate(zip(g_got, g_want)):
    assert rel_err(a, r) < 1e-5, f"gradient of argument {i}"


# Unpacked: the packed case covers it (one document per row is a special case); slow.
@pytest.mark.parametrize("packed,zigzag", [(True, False), (True, True),
                                           pytest.param(False, True, marks=pytest.mark.slow)])
def test_kda_shards_equal_one_device(mesh, packed, zigzag):
  *args, w = _kda_inputs(0)
  seg = _segments() if packed else None
  opts = dict(chunk_size=16, lower_bound=-5.0, zigzag=zigzag)
  single = lambda *a: kda(*a, segment_ids=seg, impl="chunked", chunk_size=16,
                          lower_bound=-5.0)[0]
  if packed:
    body = lambda q, k, v, g, b, s: kda_shard(q, k, v, g, b, segment_ids=s, **opts)
    sharded = lambda *a: _sharded(mesh, body, 6, zigzag)(*a, seg)
  else:
    sharded = _sharded(mesh, lambda *a: kda_shard(*a, **opts), 5, zigzag)
  _check_value_and_grads(single, sharded, args, w)


@pytest.mark.parametrize("zigzag", LAYOUTS)
def test_latent_attention_shards_equal_one_device(mesh, zigzag):
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
                                                     block=8, zigzag=zigzag)
  _check_value_and_grads(single, lambda *a: _sharded(mesh, body, 4, zigzag)(*a, seg),
                         (q, c, k_r), w)


@pytest.mark.parametrize("zigzag", LAYOUTS)
def test_previous_tokens_is_the_left_halo(mesh, zigzag):
  """Each local piece gets the last 3 tokens of the piece before it in sequence order."""
  x = jnp.arange(B * T * 2, dtype=jnp.float32).reshape(B, T, 2)
  table = piece_table(N, zigzag)
  m, size = table.shape[1], T // table.size
  f = jax.shard_map(lambda x: previous_tokens(x, 3, zigzag=zigzag), mesh=mesh, in_specs=SEQ,
                    out_specs=SEQ, check_vma=False)
  halo = np.asarray(f(x[:, _layout_order(zigzag)])).reshape(B, N, m, 3, 2)
  for r in range(N):
    for j, p in enumerate(table[r]):
      want = 0.0 if p == 0 else np.asarray(x)[:, p * size - 3:p * size]
      np.testing.assert_array_equal(halo[:, r, j], want, err_msg=f"shard {r} piece {p}")


@pytest.mark.parametrize("zigzag", LAYOUTS)
def test_short_conv_halo_equals_one_device(mesh, zigzag):
  """The explicit halo == the unsharded conv, forward and gradients (x and taps), with
  document starts at shard and piece boundaries (row 1 at 24 and 60) and inside them."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((B, T, 3)), jnp.float32)
  w4 = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((B, T, 3)), jnp.float32)
  seg = _segments()
  single = lambda x, taps: short_conv(x, taps, segment_ids=seg)
  body = lambda x, s, taps: short_conv_shard(x, taps, segment_ids=s, zigzag=zigzag)
  f = jax.shard_map(body, mesh=mesh, in_specs=(SEQ, SEQ, P()), out_specs=SEQ,
                    check_vma=False)
  perm = _layout_order(zigzag)
  sharded = lambda x, taps: f(x[:, perm], seg[:, perm], taps)[:, np.argsort(perm)]
  _check_value_and_grads(single, sharded, (x, w4), w)


@pytest.mark.parametrize("zigzag", LAYOUTS)
def test_layout_moves_are_the_permutation(zigzag):
  """to_layout == gathering the tokens in layout order; from_layout undoes it (any trailing
  shape, ints too), on a mesh that also splits the batch."""
  mesh = make_mesh(data=2, context=N)
  cp = ContextParallel(mesh, zigzag=zigzag)
  x = jnp.arange(B * T * 3, dtype=jnp.float32).reshape(B, T, 3)
  ids = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T)
  perm = _layout_order(zigzag)
  with jax.set_mesh(mesh):
    for a in (x, ids):
      placed = jax.device_put(a, batch_sharding(mesh, sequence=True))
      moved = jax.jit(cp.to_layout)(placed)
      np.testing.assert_array_equal(moved, np.asarray(a)[:, perm])
      np.testing.assert_array_equal(jax.jit(cp.from_layout)(moved), a)


@pytest.mark.parametrize("zigzag", LAYOUTS)
def test_kda_cross_shard_bytes_do_not_grow_with_length(mesh, zigzag):
  """Forward and backward of the sharded KDA at T = 2K and 8K tokens (inputs already in the
  layout): the same collectives with the same bytes (the (A, B) maps of the n or 2n pieces
  and the boundary ids, not the sequence)."""
  def hlo(t):
    sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    args = (sd(1, t, 1, 16), sd(1, t, 1, 16), sd(1, t, 1, 16), sd(1, t, 1, 16), sd(1, t, 1),
            jax.ShapeDtypeStruct((1, t), jnp.int32))
    body = lambda q, k, v, g, b, s: kda_shard(q, k, v, g, b, segment_ids=s, chunk_size=16,
                                              lower_bound=-5.0, zigzag=zigzag)
    f = _sharded(mesh, body, 6)
    loss = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2, 3, 4))
    return jax.jit(loss).lower(*args).compile().as_text()

  short, long = collective_bytes(hlo(2048)), collective_bytes(hlo(8192))
  assert short and "all-gather" in short, short
  assert short == long, (short, long)
  # The maps: N shards x m pieces x [1, 1, 16, 16 + 16] fp32, far below one shard's
  # activations.
  pieces = 2 if zigzag else 1
  assert short["all-gather"] < 4 * pieces * 16 * 32 * 4 * 2, short


# --------------------------------------------------------------------------- whole model
def _hybrid_config():
  """KDA then MLA, each followed by the MoE (experts exercised), packed documents."""
  cfg = mini_model_config(num_experts=4, experts_per_token=2)
  return dataclasses.replace(cfg, layer_kinds=("kda", "mla"),
                             moe=dataclasses.replace(cfg.moe, first_dense_layers=0))


def _tokens_and_segments():
  rng = np.random.default_rng(2)
  return jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32), _segments()


def _logits_and_grads(model, tokens, seg):
  """-> (logits, pure-dict gradients, the experts each MoE layer ran {layer: [B, T, k]})."""
  def loss(model):
    logits, aux = model(tokens, segment_ids=seg, record_routes=True)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * (seg > 0)), (logits, aux["routes"])

  (_, (logits, routes)), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  return logits, nnx.to_pure_dict(grads), routes


# Only zigzag x expert x context is a default test: it runs the layout moves, the sharded
# mixers (pieces, halo) and the EP MoE; the contiguous layouts are the same code with one
# piece per shard (each op's tests above cover both layouts), so they are slow.
@pytest.mark.parametrize("sizes,zigzag", [
    pytest.param(dict(data=2, context=4), False, marks=pytest.mark.slow),
    pytest.param(dict(expert=2, context=4), False, marks=pytest.mark.slow),
    (dict(expert=2, context=4), True)])
def test_whole_model_logits_and_gradients_equal_one_device(sizes, zigzag):
  """HybridLM with its KDA and MLA layers sequence-sharded (contiguous or zigzag; documents
  cross shard and piece boundaries) and, with `expert`, its experts over `expert`: logits
  and every parameter gradient == the plain model's, to 1e-5 relative.

  The KDA layer's gradients carry fp32 summation-order noise near 1e-5: the plain model's
  two exact KDA forms (chunked and the token scan) already differ by up to ~1.5e-5 on its
  leaves (a_log, f_b, k_conv). Every leaf of one module gets its gradient through the same
  backward, so a leaf may deviate by twice the largest chunked-vs-scan difference within its
  module (the measured floor; on this box the CP model's worst leaf is at about 1x that
  floor). A wrong carry, halo or layout is >= 1e-3."""
  cfg = _hybrid_config()
  compute = ComputeConfig(kda_chunk_size=16)
  tokens, seg = _tokens_and_segments()
  # Jitted: the chunked KDA op by op costs twice its compile; the token scan is cheaper eager.
  want = nnx.jit(_logits_and_grads)(HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute), tokens,
                                    seg)
  scan = _logits_and_grads(HybridLM(cfg, rngs=nnx.Rngs(0), compute=dataclasses.replace(
      compute, kda_impl="recurrent")), tokens, seg)
  flat_scan = dict(jax.tree_util.tree_flatten_with_path(scan[1])[0])
  mesh = make_mesh(**sizes)
  dispatch = ExpertParallelDispatch(mesh) if sizes.get("expert", 1) > 1 else None
  plan = ExecutionPlan(context=ContextParallel(mesh, block=8, zigzag=zigzag),
                       moe_dispatch=dispatch)
  model = HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute)
  placed = [jax.device_put(x, batch_sharding(mesh, sequence=True)) for x in (tokens, seg)]
  with jax.set_mesh(mesh):
    got = nnx.jit(_under(plan, _logits_and_grads))(model, *placed)
  assert rel_err(got[0], want[0]) < 1e-5
  for i, experts in want[2].items():   # recorded routes come back in sequence order
    np.testing.assert_array_equal(got[2][i], experts, err_msg=f"routes of layer {i}")
  flat_got = dict(jax.tree_util.tree_flatten_with_path(got[1])[0])
  flat_want = jax.tree_util.tree_flatten_with_path(want[1])[0]
  assert len(flat_got) == len(flat_want)
  # ['layers'][i]['mixer' | 'ffn' | ...] or the top-level module (embed, lm_head, ...)
  module = lambda path: path[:3] if path[0].key == "layers" else path[:1]
  floor = collections.defaultdict(float)   # module -> worst chunked-vs-scan leaf in it
  for path, w in flat_want:
    floor[module(path)] = max(floor[module(path)], rel_err(flat_scan[path], w))
  for path, w in flat_want:
    tol = max(1e-5, 2 * floor[module(path)])
    assert rel_err(flat_got[path], w) < tol, (jax.tree_util.keystr(path), tol)


# --------------------------------------------------------------------------- MoE routing
_MOVES = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter|collective-permute|"
                    r"all-to-all)(?:-start)?\((.*)$", re.M)
_ALONE = re.compile(r"replica_groups=(\{\{\d+\}(,\{\d+\})*\}|\[\d+,1\])")


def _moving_collectives(hlo: str) -> collections.Counter:
  """(kind, result arrays ((dtype, dims), ...)) -> count, over the collectives of compiled
  HLO text that move data: all-reduces over size-1 mesh axes (groups of one device, left
  by shard_map's transpose) are left out."""
  out = collections.Counter()
  for m in _MOVES.finditer(hlo):
    if _ALONE.search(m.group(3)):
      continue
    arrays = tuple((dt, tuple(int(d) for d in dims.split(",") if d))
                   for dt, dims in HLO_ARRAY.findall(m.group(1)))
    out[(m.group(2), arrays)] += 1
  return out


_E = 6   # experts: no other array of the model has a trailing dimension of 6


def _routing_hlo(mesh, t, dispatch=None):
  """Compiled forward + backward of a one-layer KDA + MoE model on B = 2 rows of t tokens,
  sequence-sharded: both rows on every device (a plain [B, T] -> [B T] reshape of the
  tokens is then no local op)."""
  cfg = mini_model_config(num_experts=_E, experts_per_token=2)
  cfg = dataclasses.replace(cfg, layer_kinds=("kda",), num_layers=1,
                            moe=dataclasses.replace(cfg.moe, first_dense_layers=0))
  model = HybridLM(cfg, rngs=nnx.Rngs(0), compute=ComputeConfig(kda_chunk_size=16))
  graphdef, state = nnx.split(model)

  # The input embeddings are given: the token lookup's all-to-all of each device's rows
  # (`layers.embed`) grows with T by design and is not the routing under test.
  @functools.partial(_under, ExecutionPlan(context=ContextParallel(mesh), moe_dispatch=dispatch))
  def loss(state, embeds, seg):
    logits, aux = nnx.merge(graphdef, state)(None, inputs_embeds=embeds, segment_ids=seg,
                                             record_routes=True)
    return jnp.mean(logits[..., 0] * (seg > 0)) + 0 * jnp.sum(aux["routes"][0])

  ids = jax.ShapeDtypeStruct((2, t), jnp.int32, sharding=batch_sharding(mesh, sequence=True))
  embeds = jax.ShapeDtypeStruct((2, t, cfg.d_model), jnp.float32,
                                sharding=batch_sharding(mesh, sequence=True))
  with jax.set_mesh(mesh):
    return jax.jit(jax.grad(loss)).lower(state, embeds, ids).compile().as_text()


def test_moe_routing_moves_nothing_that_grows_with_length(mesh):
  """The MoE under context parallelism (routing, its statistics, the local experts and
  the recorded routes) on each device's own tokens: the compiled training step at T = 64
  and 128 has the same collectives with the same shapes (before, XLA gathered the [B T, d]
  inputs, or with one row per device the [B T, E] router scores, onto every device)."""
  mesh4 = jax.make_mesh((1, 1, N), ("data", "fsdp", CONTEXT_AXIS),
                        axis_types=(AxisType.Auto,) * 3, devices=jax.devices()[:N])
  short, long = (_moving_collectives(_routing_hlo(mesh4, t)) for t in (64, 128))
  assert short, "no collectives parsed"
  assert short == long, (short - long, long - short)


@pytest.mark.slow
def test_expert_parallel_routing_gathers_no_scores():
  """With the experts over `expert` (2) and the sequence over `context` (4): what grows with
  T is the expert exchange of each device's own tokens, never a [*, E] router array."""
  mesh = make_mesh(expert=2, context=N)
  short, long = (_moving_collectives(_routing_hlo(mesh, t, ExpertParallelDispatch(mesh)))
                 for t in (64, 128))
  grown = list(short - long) + list(long - short)
  assert grown, "the expert exchange should grow with T"
  scores = [c for c in grown if any(dims and dims[-1] == _E for _, dims in c[1])]
  assert not scores, scores


@pytest.mark.parametrize("replayed", [False, True])
def test_moe_layer_on_token_shards_equals_one_device(replayed):
  """The MoE with the context runner on 8 devices (rows over data, 2 rows a device; the
  sequence over context) == the plain MoE: outputs and the experts run, the QB statistics
  exactly (integer sums over all token shards, padding left out), and the gradients of
  every parameter and of the input; with routing replay (given experts, weighted by the
  router) too."""
  mesh = make_mesh(data=2, context=N)
  cfg = dataclasses.replace(mini_model_config(num_experts=_E, experts_per_token=2).moe,
                            latent_dim=8, balancing="qb")
  rng = np.random.default_rng(4)
  b, d = 4, 16
  x = jnp.asarray(rng.standard_normal((b, T, d)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((b, T, d)), jnp.float32)
  mask = jnp.asarray(np.arange(T)[None] < np.array([[T], [T - 3], [50], [T]]))
  replay = (jnp.asarray(np.argsort(rng.random((b, T, _E)), -1)[..., :2], jnp.int32)
            if replayed else None)
  make = lambda: MoE(d, cfg, norm_eps=1e-6, compute=ComputeConfig(), rngs=nnx.Rngs(0))

  def run(model, x, mask, replay):
    def loss(model, x):
      y, stats, experts = model(x, mask=mask, replay=replay)
      return jnp.sum(y * w), (y, stats, experts)
    (_, out), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
    return out, (nnx.to_pure_dict(grads[0]), grads[1])

  want = nnx.jit(run)(make(), x, mask, replay)
  put = lambda a: None if a is None else jax.device_put(a, batch_sharding(mesh, sequence=True))
  with jax.set_mesh(mesh):
    got = nnx.jit(_under(ExecutionPlan(context=ContextParallel(mesh)), run))(
        make(), put(x), put(mask), put(replay))
  (y, stats, experts), grads = got
  assert rel_err(y, want[0][0]) < 1e-5
  np.testing.assert_array_equal(experts, want[0][2])
  if replayed:
    np.testing.assert_array_equal(experts, replay)
  for key in want[0][1]:
    np.testing.assert_array_equal(stats[key], want[0][1][key], err_msg=key)
  assert int(stats["load"].sum()) == 2 * int(mask.sum())
  flat_want = jax.tree_util.tree_flatten_with_path(want[1])[0]
  flat_got = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
  assert len(flat_got) == len(flat_want)
  for path, g in flat_want:
    assert rel_err(flat_got[path], g) < 1e-5, jax.tree_util.keystr(path)
