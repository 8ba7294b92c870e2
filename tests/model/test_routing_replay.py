"""Routing replay through HybridLM (DESIGN s9): record the experts of every MoE layer, replay
them with other parameters, with remat and with a cache; bad routes raise before compute.

The tiny preset cut to what routing touches: 3 MLA layers (a dense first layer, then MoE
layers 1 and 2 with E=8, k=2, no latent or shared experts), no AttnRes; B=2, T=12. The KDA
scan, AttnRes and the latent / shared experts would double the compile time of the file
(replay acts on the routes only, whatever the mixers).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.cache import init_cache
from hybridmoe_jax.model.decoder import check_routes
from hybridmoe_jax.ops.routing import expert_load
from tests._support import rel_rms
from tests._support import tiny_model_config
from tests.model.test_model import RECURRENT

B, T = 2, 12


@nnx.jit
def _forward(model, tokens, routes=None):
  """-> (logits [B, T, V], recorded routes {i: [B, T, k]}, routing stats)."""
  logits, aux = model(tokens, routes=routes, record_routes=True)
  return logits, aux["routes"], aux["moe"]


def _is_router(path, _):
  return path[-1] == "router"


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grad(graphdef, params, rest, tokens, routes):
  """Next-token NLL under replay and its gradient w.r.t. `params` (the routers' weights:
  the whole backward, without the other weights' gradients, compiles in 2/3 the time)."""
  def loss(params, rest):
    # As in train/step.py: the state held fixed enters through stop_gradient, which puts it
    # at this trace level (nnx.remat writes the layer state back after each call).
    logits = nnx.merge(graphdef, params, jax.lax.stop_gradient(rest))(tokens,
                                                                       routes=routes)[0]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                                         tokens[:, 1:, None], axis=-1))
  return jax.value_and_grad(loss)(params, rest)


@nnx.jit
def _chunk(model, tokens, cache, routes):
  logits, aux = model(tokens, cache=cache, routes=routes, record_routes=True, kv_block=4)
  return logits, aux["cache"], aux["routes"]


@pytest.fixture(scope="module")
def setup():
  """(cfg, model, a copy with perturbed routers, tokens, its fresh forward)."""
  cfg = tiny_model_config(num_layers=3, layer_kinds=("mla",) * 3,
                 attnres={"enabled": False, "block_size": 2},
                 moe={"latent_dim": 0, "num_shared_experts": 0, "routed_scale": 2.0})
  model = HybridLM(cfg, rngs=nnx.Rngs(0), compute=RECURRENT)
  moved = nnx.clone(model)
  keys = jax.random.split(jax.random.PRNGKey(5), len(cfg.moe_layers))
  for i, key in zip(cfg.moe_layers, keys):
    router = moved.layers[i].ffn.router
    router[...] = router[...] + 0.1 * jax.random.normal(key, router[...].shape)
  tokens = jax.random.randint(jax.random.PRNGKey(3), (B, T), 0, cfg.vocab_size)
  return cfg, model, moved, tokens, _forward(model, tokens)


def _assert_routes_equal(got, want):
  assert sorted(got) == sorted(want)
  for i in want:
    np.testing.assert_array_equal(got[i], want[i], err_msg=f"layer {i}")


def test_recorded_routes_shape_and_same_params_replay_is_identical(setup):
  cfg, model, _, tokens, (logits, routes, stats) = setup
  assert sorted(routes) == list(cfg.moe_layers) and 0 not in routes   # layer 0 is dense
  k, e = cfg.moe.experts_per_token, cfg.moe.num_experts
  for ids in routes.values():
    assert ids.shape == (B, T, k) and ids.dtype == jnp.int32
    assert int(ids.min()) >= 0 and int(ids.max()) < e
  check_routes(cfg, routes, (B, T))
  got_logits, got_routes, got_stats = _forward(model, tokens, routes)
  np.testing.assert_array_equal(got_logits, logits)
  _assert_routes_equal(got_routes, routes)
  jax.tree.map(np.testing.assert_array_equal, got_stats, stats)


def test_replay_with_moved_routers_keeps_the_recorded_experts(setup):
  cfg, _, moved, tokens, (_, recorded, _) = setup
  fresh_logits, fresh_routes, fresh_stats = _forward(moved, tokens)
  changed = sum(int(np.any(np.asarray(fresh_routes[i]) != np.asarray(recorded[i]), -1).sum())
                for i in recorded)
  assert changed > 0, "the perturbation moved no token's routes: the test checks nothing"
  logits, routes, stats = _forward(moved, tokens, recorded)
  _assert_routes_equal(routes, recorded)
  assert float(jnp.max(jnp.abs(logits - fresh_logits))) > 1e-4
  # Balancing statistics describe each router's own top-k, replay or not: the first MoE
  # layer sees the same input either way, so its stats equal the fresh forward's (and not
  # the load of the replayed experts, which the perturbation moved).
  first = cfg.moe_layers[0]
  got, want = (s["layers"][first]["ffn"]["bias"] for s in (stats, fresh_stats))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  replayed_load = expert_load(recorded[first].reshape(-1, cfg.moe.experts_per_token),
                              cfg.moe.num_experts)
  assert np.any(np.asarray(replayed_load) != np.asarray(got["load"]))
  # Layers left out route freshly: replaying only the last MoE layer leaves the first one
  # on the moved router's own choice.
  last = cfg.moe_layers[-1]
  _, routes = _forward(moved, tokens, {last: recorded[last]})[:2]
  _assert_routes_equal(routes, {first: fresh_routes[first], last: recorded[last]})


def test_router_gradient_under_replay_and_remat_full_equals_none(setup):
  cfg, model, moved, tokens, (_, recorded, _) = setup
  full = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0),
                                         compute=dataclasses.replace(RECURRENT, remat="full")))
  full = nnx.merge(nnx.graphdef(full), nnx.state(moved))
  routers = nnx.All(nnx.Param, _is_router)
  loss, grads = _loss_and_grad(*nnx.split(moved, routers, ...), tokens, recorded)
  loss_full, grads_full = _loss_and_grad(*nnx.split(full, routers, ...), tokens, recorded)
  assert np.isfinite(float(loss)) and abs(float(loss) - float(loss_full)) <= 1e-6 * abs(
      float(loss))
  for i in cfg.moe_layers:
    g = np.asarray(grads["layers"][i]["ffn"]["router"][...])
    assert np.all(np.isfinite(g)) and float(np.max(np.abs(g))) > 0.0, f"layer {i}"
  assert len(jax.tree.leaves(grads)) == len(cfg.moe_layers)
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(grads),
                               jax.tree_util.tree_leaves_with_path(grads_full)):
    assert rel_rms(b, a) <= 1e-6, jax.tree_util.keystr(path)


def test_cached_chunks_replay_like_the_full_forward(setup):
  """Two prefill chunks of 6 with a cache replay their slices of the routes recorded with
  the old routers: same experts, logits == the full replayed forward (routes fixed, so no
  near-tie can flip between the cached and the full forward)."""
  cfg, _, moved, tokens, (_, recorded, _) = setup
  full_logits = _forward(moved, tokens, recorded)[0]
  cache, outs, got = init_cache(cfg, B, T), [], []
  for s in (0, 6):
    part = {i: ids[:, s:s + 6] for i, ids in recorded.items()}
    logits, cache, routes = _chunk(moved, tokens[:, s:s + 6], cache, part)
    outs.append(logits)
    got.append(routes)
  _assert_routes_equal({i: jnp.concatenate([r[i] for r in got], 1) for i in recorded},
                       recorded)
  assert rel_rms(jnp.concatenate(outs, 1), full_logits) < 1e-5


def test_bad_routes_raise_before_compute(setup, monkeypatch):
  cfg, model, _, tokens, (_, recorded, _) = setup
  good = {i: np.asarray(ids) for i, ids in recorded.items()}
  layer = cfg.moe_layers[0]
  ids = good[layer]
  bad_cases = [
      ({0: ids}, "has key 0: allowed the MoE layer indices"),     # layer 0 is dense
      ({layer: ids[:, :5]}, "must be integer expert ids of shape"),
      ({layer: ids.astype(np.float32)}, "must be integer expert ids"),
      ({layer: np.where(ids == ids[0, 0, 0], 8, ids)}, "allowed \\[0, 7\\]"),
      ({layer: np.repeat(ids[..., :1], 2, axis=-1)}, "repeats an expert"),
      ([ids], "must be a dict"),
  ]
  # Every forward embeds the tokens first: fail if any compute starts.
  monkeypatch.setattr(type(model.embed), "__call__",
                      lambda *a, **kw: pytest.fail("the forward started computing"))
  for routes, match in bad_cases:
    with pytest.raises(ValueError, match=f"^routes.*{match}"):
      model(tokens, routes=routes)
  monkeypatch.undo()
  # Under jit the shapes are still checked (at trace time); the ids are tracers there.
  with pytest.raises(ValueError, match=f"^routes\\[{layer}\\] must be integer expert ids"):
    _forward(model, tokens, {layer: jnp.asarray(ids[:, :5])})
