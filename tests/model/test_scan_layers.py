"""The scanned layer stack (compute.scan_layers) == the per-layer loop with the same weights:
the split, forward, backward, routing stats and replay, cached decode, one train step, the
state layouts and the sharding of the stacked weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from hybridmoe_jax.config import (AttnResConfig, ComputeConfig, KDAConfig, MLAConfig,
                                  ModelConfig, MoEConfig, model_config_from_dict)
from hybridmoe_jax.config.sharding import path_string
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.cache import init_cache
from hybridmoe_jax.model.count import COMPONENTS, _component, param_breakdown
from hybridmoe_jax.model.stack import (LayerSplit, find_period, layer_split, stack_state,
                                       unstack_state)
from hybridmoe_jax.parallel.mesh import build_mesh
from hybridmoe_jax.parallel.rules import tree_shardings
from hybridmoe_jax import loading
from hybridmoe_jax.train import optim, params_export
from hybridmoe_jax.train.state import split_model, TrainState
from hybridmoe_jax.train.step import make_train_step
from tests._support import MINI_KDA, MINI_MLA, MINI_MOE, assert_close
from tests.conftest import load_config

# 7 layers "KM KM KM M", layer 0 dense: prefix 0-1, scanned 2-5 (2 repeats of KDA + MLA),
# tail 6. AttnRes blocks of 3 layers: the scanned layers' slots (1, 2 | 2, 2) differ
# between repeats and inside one, so the traced slot is exercised.
KINDS = ("kda", "mla") * 3 + ("mla",)
SPLIT = LayerSplit(num_layers=7, period=2, start=2, repeats=2)
PLAIN = ComputeConfig(kda_impl="recurrent", remat="full")
SCANNED = dataclasses.replace(PLAIN, scan_layers=True)


def _config(attnres: bool = True) -> ModelConfig:
  return ModelConfig(vocab_size=64, d_model=16, num_layers=len(KINDS), layer_kinds=KINDS,
                     kda=KDAConfig(**MINI_KDA), mla=MLAConfig(**MINI_MLA),
                     moe=MoEConfig(**MINI_MOE),
                     attnres=AttnResConfig(enabled=attnres, block_size=3))


def _pair(cfg: ModelConfig, plain: ComputeConfig = PLAIN):
  """(per-layer model, scanned model) holding the same weights."""
  a = HybridLM(cfg, rngs=nnx.Rngs(0), compute=plain)
  b = HybridLM(cfg, rngs=nnx.Rngs(1), compute=dataclasses.replace(plain, scan_layers=True))
  nnx.update(b, stack_state(nnx.state(a), cfg))
  return a, b


def _tokens(seed, b, t):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, 64)


def _packed(b=2, t=12):
  """Several documents per row, and padding."""
  seg = jnp.array([[1] * 5 + [2] * 4 + [3] * 3, [1] * 9 + [0] * 3], jnp.int32)
  return _tokens(0, b, t), seg


def _assert_trees_equal(got, want, rtol=0.0, what="", atol=1e-6):
  """Same structure; leaves equal (rtol 0) or close (`assert_close`)."""
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    if rtol:
      assert_close(g, w, rtol, f"{what} {path_string(path)}", atol=atol)
    else:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), f"{what} {path_string(path)}")


# ------------------------------------------------------------------------------ the split
def _preset(name) -> ModelConfig:
  return model_config_from_dict(load_config(name).model)


@pytest.mark.parametrize("name, want, tail", [
    ("tiny", LayerSplit(4, 0, 4, 0), range(4, 4)),       # one period, holding the dense layer
    ("small", LayerSplit(8, 4, 4, 1), range(8, 8)),
    ("kimi_linear_48b", LayerSplit(27, 4, 4, 5), range(24, 27)),
    ("kimi_k3", LayerSplit(93, 4, 4, 22), range(92, 93)),
])
def test_split_of_the_presets(name, want, tail):
  split = layer_split(_preset(name))
  assert split == want
  assert range(split.end, split.num_layers) == tail


def test_find_period():
  assert find_period(("kda",) * 5) == 1
  assert find_period(("kda", "kda", "kda", "mla")) == 0          # a single copy
  assert find_period(("kda", "mla") * 3 + ("kda",)) == 2
  assert find_period(("kda", "kda", "mla") * 2 + ("mla", "mla", "mla")) == 0  # tail >= P
  cfg = _config()
  assert layer_split(cfg) == SPLIT
  # Two dense layers: the first whole period holding them stays unscanned.
  dense2 = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, first_dense_layers=3))
  assert layer_split(dense2) == LayerSplit(7, 2, 4, 1)


# ------------------------------------------------------------------------- state layouts
def test_stack_and_unstack_state_are_inverses():
  cfg = _config()
  a, b = _pair(cfg)
  per_layer, stacked = nnx.state(a), nnx.state(b)
  assert sorted(stacked["layers"]) == [0, 1, 6] and sorted(stacked["stack"]) == [0, 1]
  assert stacked["stack"][1]["mixer"]["kv_a"]["kernel"].shape == (2, 16, 8)
  _assert_trees_equal(unstack_state(stacked, cfg), per_layer, what="unstacked")
  _assert_trees_equal(stack_state(unstack_state(stacked, cfg), cfg), stacked, what="restacked")
  # Pure dicts with string keys (an export read back) convert too.
  pure = jax.tree.map(np.asarray, nnx.to_pure_dict(per_layer))
  strs = {**pure, "layers": {str(i): v for i, v in pure["layers"].items()}}
  assert sorted(stack_state(strs, cfg)["stack"]) == ["0", "1"]
  _assert_trees_equal(unstack_state(stack_state(strs, cfg), cfg), strs, what="str keys")
  with pytest.raises(ValueError, match="some of the scanned layers"):
    stack_state({"layers": {2: pure["layers"][2]}}, cfg)


def test_a_params_export_of_the_other_layout_names_the_conversion(tmp_path):
  """Loading a scanned run's export into a per-layer model fails naming compute.scan_layers
  and the conversion; converted, the stored tree is the per-layer model's."""
  cfg = _config()
  a, b = _pair(cfg)
  _, params, biases, _ = split_model(b)
  path = params_export.export_params(str(tmp_path / "export"), params, biases, {})
  _, want_params, want_biases, _ = split_model(a)
  expected = {"params": nnx.to_pure_dict(want_params),
              "routing_biases": nnx.to_pure_dict(want_biases)}
  with pytest.raises(ValueError, match=r"compute.scan_layers.*model.stack.unstack_state"):
    loading.load_exported_params(path, expected)
  stored = loading.load_exported_params(path)
  for name in expected:
    converted = unstack_state(stored[name], cfg)
    assert not loading.tree_mismatch(expected[name], converted)
    _assert_trees_equal(jax.tree.leaves(converted),
                        [np.asarray(x) for x in jax.tree.leaves(expected[name])],
                        what=name)


def _state_breakdown(cfg: ModelConfig, params: nnx.State) -> dict[str, int]:
  """Parameters per component of an actual (or abstract) model state, either layout."""
  counts = dict.fromkeys(COMPONENTS, 0)
  for path, leaf in nnx.to_flat_state(params):
    shape = tuple(leaf.shape)
    counts[_component(cfg, tuple(str(p) for p in path), shape)] += int(np.prod(shape))
  return counts


def test_parameter_counts_do_not_depend_on_the_layout():
  cfg = _config()
  counts = param_breakdown(cfg)
  for compute in (PLAIN, SCANNED):
    params = nnx.state(nnx.eval_shape(lambda c=compute: HybridLM(cfg, rngs=nnx.Rngs(0),
                                                                  compute=c)), nnx.Param)
    assert _state_breakdown(cfg, params) == counts


# ------------------------------------------------------------- forward, backward, replay
def _fixed_routes(cfg: ModelConfig, layers, b: int, t: int) -> dict[int, jax.Array]:
  """Replayed routes: per layer one fixed set of k distinct experts for every token."""
  k, e = cfg.moe.experts_per_token, cfg.moe.num_experts
  ids = lambda i: jax.random.permutation(jax.random.PRNGKey(i), e)[:k]
  return {i: jnp.broadcast_to(ids(i), (b, t, k)).astype(jnp.int32) for i in layers}


@nnx.jit
def _loss_and_grads(model, tokens, seg, weights, routes):
  """A loss that reads every logit -> (logits, stats, routes run, grads w.r.t. params)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    # Fresh variables of this trace (as the train step's stop_gradient gives).
    model = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))
    logits, aux = model(tokens, segment_ids=seg, routes=routes, record_routes=True)
    return jnp.sum(logits * weights), (logits, aux)

  (_, (logits, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params)
  return logits, aux["moe"], aux["routes"], grads


@pytest.mark.parametrize("attnres, replay", [(True, False), (False, True)])
def test_forward_and_gradients_equal_the_layer_loop(attnres, replay):
  """Packed documents, remat "full". Without AttnRes the MoE layers replay fixed routes:
  the scanned ones take theirs as scan xs, and the router still gets its gradient."""
  cfg = _config(attnres)
  a, b = _pair(cfg)
  tokens, seg = _packed()
  routes = _fixed_routes(cfg, cfg.moe_layers, 2, 12) if replay else None
  weights = jax.random.normal(jax.random.PRNGKey(3), (2, 12, 64))
  la, sa, ra, ga = _loss_and_grads(a, tokens, seg, weights, routes)
  lb, sb, rb, gb = _loss_and_grads(b, tokens, seg, weights, routes)
  assert_close(lb, la, 1e-6, "logits")
  # Stats are shaped like the stacked bias state; unstacked they are the loop's, exactly.
  assert sb["stack"][0]["ffn"]["bias"]["load"].shape == (2, cfg.moe.num_experts)
  _assert_trees_equal(unstack_state(sb, cfg), sa, what="stats")
  assert list(rb) == list(ra) == list(cfg.moe_layers)
  _assert_trees_equal(rb, ra, what="routes")
  if replay:
    _assert_trees_equal(rb, routes, what="replayed routes")
  # atol: a router under replay of k = 1 expert has weight 1, its gradient float noise.
  _assert_trees_equal(unstack_state(gb, cfg), ga, rtol=1e-5, what="grads", atol=1e-5)


# --------------------------------------------------------------------------- decode cache
@nnx.jit
def _chunk(model, tokens, seg, cache, routes):
  logits, aux = model(tokens, segment_ids=seg, cache=cache, kv_block=4, routes=routes)
  return logits, aux["cache"], aux["moe"]


def test_cached_decode_equals_the_layer_loop():
  """Two chunks of 4 (one padded row): the stack runs as a loop over its repeats' slices.
  Layers 1 and 4 replay fixed routes (4 is scanned: only some of its position's repeats
  replay, which also takes the loop)."""
  cfg = _config()
  a, b = _pair(cfg)
  tokens = _tokens(7, 2, 8)
  caches = [init_cache(cfg, 2, 12), init_cache(cfg, 2, 12)]
  routes = _fixed_routes(cfg, (1, 4), 2, 4)
  for s in (0, 4):
    seg = jnp.ones((2, 4), jnp.int32).at[1, 3:].set(0 if s else 1)
    (la, caches[0], sa), (lb, caches[1], sb) = (
        _chunk(m, tokens[:, s:s + 4], seg, c, routes) for m, c in zip((a, b), caches))
    assert_close(lb, la, 1e-6, f"chunk at {s}")
    _assert_trees_equal(unstack_state(sb, cfg), sa, what="cached stats")
  _assert_trees_equal(caches[1], caches[0], rtol=1e-6, what="caches")


# ------------------------------------------------------------------------ one train step
def _train_state(model, tx):
  # Copies: the step donates its state, and the two models share their unscanned arrays.
  graphdef, params, biases, rest = jax.tree.map(jnp.copy, split_model(model))
  return graphdef, TrainState(step=jnp.zeros((), jnp.int32), params=params,
                              opt_state=tx.init(params), biases=biases, rest=rest,
                              rng=jax.random.PRNGKey(1), skipped=jnp.zeros((), jnp.int32))


def test_train_step_equals_the_layer_loop():
  """Loss, updated parameters and the routing-bias update with per-layer metrics. SGD (an
  Adam step would amplify float noise in near-zero gradients) with weight decay masked
  like the real optimizers' (a stacked vector must not count as a matrix)."""
  cfg = _config()
  a, b = _pair(cfg, dataclasses.replace(PLAIN, remat="none"))  # remat: tested above
  schedule = optax.constant_schedule(0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.add_decayed_weights(0.5, mask=optim.decay_mask), optax.sgd(schedule))
  tokens, seg = _packed()
  out = []
  for model in (a, b):
    graphdef, state = _train_state(model, tx)
    step = make_train_step(graphdef, cfg, tx, grad_accum=1, schedule=schedule)
    out.append(step(state, {"tokens": tokens, "segment_ids": seg}))
  (sa, ma), (sb, mb) = out
  assert_close(mb["loss"], ma["loss"], 1e-6, "loss")
  _assert_trees_equal(unstack_state(sb.params, cfg), sa.params, rtol=1e-5, what="params")
  _assert_trees_equal(unstack_state(sb.biases, cfg), sa.biases, rtol=1e-6, what="biases")
  assert not np.allclose(sa.biases["layers"][4]["ffn"]["bias"][...], 0)   # it moved
  assert sorted(mb["moe"]) == sorted(ma["moe"]) == sorted(f"layers/{i}/ffn"
                                                           for i in cfg.moe_layers)
  _assert_trees_equal(mb["moe"], ma["moe"], rtol=1e-6, what="moe metrics")


def test_optimizer_masks_see_a_stacked_leaf_as_its_layer():
  """Weight decay and Muon's matrix choice per leaf, scanned == per-layer (by path)."""
  cfg = _config()
  shapes = {c: nnx.state(nnx.eval_shape(lambda c=c: HybridLM(cfg, rngs=nnx.Rngs(0),
                                                              compute=c)), nnx.Param)
            for c in (PLAIN, SCANNED)}
  for fn in (optim.decay_mask, optim._muon_dims):  # pylint: disable=protected-access
    plain = {path_string(p): v for p, v in
             jax.tree_util.tree_leaves_with_path(fn(shapes[PLAIN]), is_leaf=_is_mask_leaf)}
    for path, v in jax.tree_util.tree_leaves_with_path(fn(shapes[SCANNED]),
                                                       is_leaf=_is_mask_leaf):
      path = path_string(path)
      if path.startswith("stack/"):
        j, rest = path.split("/", 2)[1:]
        want = plain[f"layers/{SPLIT.index(0, int(j))}/{rest}"]
        assert (v is None) == (want is None) and (v is None or bool(v) == bool(want)), path
        if v is not None and not isinstance(v, bool):   # Muon: the same matrix dims
          assert (v.reduction_axis, v.output_axis) == (want.reduction_axis + 1,
                                                       want.output_axis + 1), path


def _is_mask_leaf(x) -> bool:
  return x is None or isinstance(x, (bool, optim.MuonDimensionNumbers))


# ------------------------------------------------------------------------------- sharding
def _specs(cfg, compute, mesh) -> dict[str, tuple]:
  """{leaf path: its PartitionSpec as a tuple without trailing Nones} of the model state."""
  state = nnx.state(nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute)))
  leaves = jax.tree_util.tree_leaves_with_path(
      tree_shardings(state, mesh), is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
  out = {}
  for path, sharding in leaves:
    spec = list(sharding.spec)
    while spec and spec[-1] is None:
      spec.pop()
    out[path_string(path)] = tuple(spec)
  return out


def test_stacked_weights_are_sharded_like_their_layer():
  """Every stacked leaf [R, ...] gets its layer's spec behind a replicated "layers" dim
  (a rank mismatch would replicate it whole: the stacked experts on every device)."""
  cfg = _config()
  mesh = build_mesh({"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}, jax.devices())
  plain, scanned = _specs(cfg, PLAIN, mesh), _specs(cfg, SCANNED, mesh)
  stacked = {p: s for p, s in scanned.items() if p.startswith("stack/")}
  assert len(stacked) == sum(p.startswith(("layers/2/", "layers/3/")) for p in plain)
  for path, spec in stacked.items():
    j, rest = path.split("/", 2)[1:]
    for r in range(SPLIT.repeats):
      want = plain[f"layers/{SPLIT.index(r, int(j))}/{rest}"]
      assert spec == ((None,) + want if want else ()), path
  assert stacked["stack/0/ffn/w_up"] == (None, "expert", "fsdp", "tensor")
  assert {p: s for p, s in scanned.items() if not p.startswith("stack/")} == {
      p: s for p, s in plain.items() if not p.startswith(tuple(f"layers/{i}/" for i in
                                                               SPLIT.scanned))}


# ----------------------------------------------------------------------------- AOT costing
def test_aot_cost_counts_every_repeat_and_microbatch():
  """XLA costs a loop body once. Outside the loops 10, per microbatch 3 outside the layer
  scan, per repeat 2; grad_accum 4, R 5: 10 + 4 (3 + 5 x 2) = 62. Compiled: (accum 1,
  scan 1) 15, (accum 2, scan 1) 20, (accum 1, scan 5) 23 (5: R's smallest divisor)."""
  from hybridmoe_jax.tools import aot  # pylint: disable=g-import-not-at-top
  # pylint: disable=protected-access
  compiled = lambda flops: aot.Compiled("x", 1, 0.0, {}, {"flops": flops})
  assert aot._smallest_divisor(5) == 5 and aot._smallest_divisor(22) == 2
  loops = [(4 - 1, 2, compiled(20.0)), (4 * (5 - 1), 5, compiled(23.0))]
  assert aot._loop_corrected({"flops": 15.0}, loops) == {"flops": 62.0}
