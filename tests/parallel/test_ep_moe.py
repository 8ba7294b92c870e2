"""Expert-parallel MoE (`ExpertParallelDispatch`: shard_map over `expert`) == the
single-device dense one-hot reference.

EP in {1, 2, 4, 8} with the remaining devices on data (and fsdp): outputs, routing stats and
gradients w.r.t. every parameter and the input, fp32, rel 1e-5; with a maximally skewed
router (every token's assignments go to expert shard 0) nothing is dropped in dropless mode;
with a capacity factor the drops are exactly the ones a numpy count predicts.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, MoEConfig
from hybridmoe_jax.layers.moe import MoE
from hybridmoe_jax.ops.plan import ExecutionPlan, execution_plan
from hybridmoe_jax.parallel.ep_moe import ExpertParallelDispatch, buffer_rows
from tests._support import rel_rms
from tests.parallel.helpers import make_mesh

D, E, K = 16, 16, 2
CFG = MoEConfig(num_experts=E, experts_per_token=K, expert_intermediate=8, latent_dim=8,
                num_shared_experts=1, shared_intermediate=8, qb_num_bins=64)
SKEW = np.zeros((E,), np.float32)
SKEW[:2] = 10.0   # experts 0 and 1 (both on expert shard 0 for EP <= 8) win every token


def _loss_fn(graphdef, dispatch=None):
  def loss(params, rest, x, r):
    model = nnx.merge(graphdef, params, rest)
    with execution_plan(ExecutionPlan(moe_dispatch=dispatch)):
      y, stats, _ = model(x, mask=jnp.ones(x.shape[:2], bool).at[0, :3].set(False))
    return jnp.sum(y * r), stats
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))


def _fwd(dispatch=None):
  """The jitted MoE forward (m, x, **kwargs), traced under a plan with `dispatch`."""
  def fwd(m, x, **kwargs):
    with execution_plan(ExecutionPlan(moe_dispatch=dispatch)):
      return m(x, **kwargs)
  return nnx.jit(fwd)


def _moe(cfg, impl="ragged"):
  return MoE(D, cfg, norm_eps=1e-5, compute=ComputeConfig(moe_impl=impl), rngs=nnx.Rngs(0))


def _run(impl, bias, x, r, cfg=CFG):
  model = _moe(cfg, impl)
  model.bias[...] = jnp.asarray(bias)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return _loss_fn(graphdef)(params, rest, x, r)


@pytest.fixture(scope="module")
def inputs():
  kx, kr = jax.random.split(jax.random.PRNGKey(7))
  x = jax.random.normal(kx, (8, 4, D), jnp.float32)
  r = jax.random.normal(kr, (8, 4, D), jnp.float32)
  rng = np.random.default_rng(0)
  bias = rng.normal(size=(E,)).astype(np.float32) * 0.1
  refs = {name: _run("dense", b, x, r) for name, b in (("random", bias), ("skewed", SKEW))}
  return x, r, {"random": bias, "skewed": SKEW}, refs


def _check(got, ref):
  (loss, stats), (g_params, g_x) = got
  (rloss, rstats), (rg_params, rg_x) = ref
  assert abs(float(loss) - float(rloss)) <= 1e-5 * abs(float(rloss))
  np.testing.assert_array_equal(stats["load"], rstats["load"])
  np.testing.assert_array_equal(stats["qb_hist"], rstats["qb_hist"])
  assert int(stats["dropped"]) == 0
  assert rel_rms(g_x, rg_x) < 1e-5
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(rg_params),
                               jax.tree_util.tree_leaves_with_path(g_params)):
    assert rel_rms(b, a) < 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize("ep,data,fsdp", [(1, 8, 1), (2, 2, 2), (4, 2, 1), (8, 1, 1)])
def test_ep_matches_dense_reference(inputs, ep, data, fsdp):
  x, r, biases, refs = inputs
  mesh = make_mesh(data=data, fsdp=fsdp, expert=ep)
  graphdef, params, rest = nnx.split(_moe(CFG), nnx.Param, ...)
  step = _loss_fn(graphdef, ExpertParallelDispatch(mesh))
  # No mesh context: the dispatch carries its mesh (the layer never reads an ambient one).
  for name in ("random", "skewed"):   # one compilation: the bias is an input
    rest["bias"].set_value(jnp.asarray(biases[name]))
    got = step(params, rest, x, r)
    _check(got, refs[name])
    if name == "skewed":  # every valid assignment went to experts 0 and 1
      assert int(got[0][1]["load"][:2].sum()) == int(got[0][1]["load"].sum())


def test_capacity_factor_drops_and_counts(inputs):
  """All tokens routed to shard 0, buffer = 1.0 x local assignments: only shard 0's own
  tokens fit, the other 7/8 of the valid assignments are dropped and contribute zero."""
  x, r, _, refs = inputs
  cfg = dataclasses.replace(CFG, num_shared_experts=0, latent_dim=0)
  mesh = make_mesh(data=1, expert=8)
  model = _moe(cfg)
  model.bias[...] = jnp.asarray(SKEW)
  with jax.set_mesh(mesh):
    y, stats, _ = _fwd(ExpertParallelDispatch(mesh, capacity_factor=1.0))(
        model, x, mask=jnp.ones(x.shape[:2], bool))
  dense = _moe(cfg, "dense")
  dense.bias[...] = jnp.asarray(SKEW)
  y_ref, _, _ = dense(x)
  m = x.shape[0] * x.shape[1]
  assert int(stats["dropped"]) == (m - m // 8) * K          # numpy count: 7/8 of all rows
  y, y_ref = np.asarray(y).reshape(m, D), np.asarray(y_ref).reshape(m, D)
  kept = m // 8                                              # shard 0's own tokens
  assert rel_rms(y[:kept], y_ref[:kept]) < 1e-5
  np.testing.assert_array_equal(y[kept:], 0.0)


def test_replay_runs_the_given_experts_and_counts_the_routers_own():
  """Routing replay through the dispatch: y == the local path under the same replay, the
  experts run are the replayed ones, and the statistics are those of the router's own top-k
  (the local path's without replay), not of the replayed experts."""
  x = jax.random.normal(jax.random.PRNGKey(8), (8, 4, D), jnp.float32)
  rng = np.random.default_rng(1)
  replay = np.stack([rng.permutation(E)[:K] for _ in range(x.shape[0] * x.shape[1])])
  replay = jnp.asarray(replay.reshape(*x.shape[:2], K), jnp.int32)
  model = _moe(CFG)
  model.bias[...] = jnp.asarray(rng.normal(size=(E,)).astype(np.float32) * 0.1)
  local, ep = _fwd(), _fwd(ExpertParallelDispatch(make_mesh(data=2, expert=4)))
  _, fresh, _ = local(model, x, replay=None)
  y_ref, stats_ref, experts_ref = local(model, x, replay=replay)
  y, stats, experts = ep(model, x, replay=replay)
  np.testing.assert_array_equal(experts, replay)
  np.testing.assert_array_equal(experts_ref, replay)
  assert rel_rms(y, y_ref) < 1e-5
  for got in (stats_ref, stats):
    jax.tree.map(np.testing.assert_array_equal, got, fresh)
  replayed_load = np.bincount(np.asarray(replay).reshape(-1), minlength=E)
  assert np.any(replayed_load != np.asarray(stats["load"]))


def test_dispatch_validates_its_arguments():
  with pytest.raises(ValueError, match="capacity_factor"):
    ExpertParallelDispatch(make_mesh(expert=8), capacity_factor=-1.0)
  with pytest.raises(ValueError, match="exchange impl"):
    ExpertParallelDispatch(make_mesh(expert=8), exchange="fast")
  bad = _moe(dataclasses.replace(CFG, num_experts=12))
  with pytest.raises(ValueError, match="12 experts do not split over mesh.expert=8"):
    with execution_plan(ExecutionPlan(
        moe_dispatch=ExpertParallelDispatch(make_mesh(data=1, expert=8)))):
      bad(jnp.zeros((8, 4, D)))


def test_buffer_rows_is_the_ceiling_of_the_exact_product():
  """R = ceil(c a) with c's decimal value: the float products 1.1 x 50 = 55.00000000000001
  and 1.1 x 100 = 110.00000000000001 gave one buffer row more than the capacity asks for."""
  assert buffer_rows(50, 8, 1.1) == 55 and buffer_rows(100, 8, 1.1) == 110
  assert buffer_rows(10, 8, 0.7) == 7 and buffer_rows(7, 8, 0.5) == 4   # 3.5 -> 4
  assert buffer_rows(10, 2, 5.0) == 20 and buffer_rows(10, 8, 0.0) == 80  # worst case G a
  assert buffer_rows(10, 8, 1e-9) == 1
