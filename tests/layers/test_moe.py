"""Tests of the MoE layer and its balancing: ragged vs dense experts, stats, the bias update
over the stats pytree, the bias as non-differentiable state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, MoEConfig
from hybridmoe_jax.layers.balancing import layer_metrics, update_bias, update_routing_biases
from hybridmoe_jax.layers.moe import GLUMLP, MoE, RoutingBias
from hybridmoe_jax.ops.plan import ExecutionPlan, execution_plan
from hybridmoe_jax.ops.quantile_balance import quantile_balance
from hybridmoe_jax.ops.routing import max_violation

D = 32


def _cfg(**kw):
  base = dict(num_experts=8, experts_per_token=2, expert_intermediate=24,
              num_shared_experts=1, shared_intermediate=16, latent_dim=0, glu="situ",
              routed_scale=1.5, qb_num_bins=64)
  return MoEConfig(**{**base, **kw})


def _moe(cfg, impl="ragged", dtype="float32", seed=0, **kw):
  return MoE(D, cfg, norm_eps=1e-5, compute=ComputeConfig(dtype=dtype, moe_impl=impl),
             rngs=nnx.Rngs(seed), **kw)


def _x(b=2, t=12, seed=1, dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(seed), (b, t, D), dtype)


def _loss(model, x, mask=None):
  y, _, _ = model(x, mask=mask)
  w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
  return jnp.sum(y.astype(jnp.float32) * w)


# Module-level jitted entry points: nnx.jit caches on the module's graph (cfg, impl) and the
# input shapes, so tests that share a config and shape compile once.
@nnx.jit
def _forward_and_grad(model, x):
  y, stats, _ = model(x)
  return y, stats, nnx.grad(_loss)(model, x)


@nnx.jit
def _forward(model, x, mask=None):
  return model(x, mask=mask)


def _assert_close(test, a, b, rtol):
  scale = float(jnp.max(jnp.abs(b)))
  test.assertLessEqual(float(jnp.max(jnp.abs(a - b))), rtol * max(scale, 1e-30))


class MoEImplTest(parameterized.TestCase):

  # Each option is covered on and off; the first case is the default config, which the other
  # tests reuse (no extra compiles).
  @parameterized.parameters(dict(latent_dim=0, num_shared_experts=1, glu="situ"),
                            dict(latent_dim=16, num_shared_experts=0, glu="swiglu"),
                            dict(latent_dim=16, num_shared_experts=2, glu="situ"),
                            dict(latent_dim=0, num_shared_experts=0, glu="swiglu"))
  def test_ragged_matches_dense(self, latent_dim, num_shared_experts, glu):
    cfg = _cfg(latent_dim=latent_dim, num_shared_experts=num_shared_experts, glu=glu)
    x = _x()
    out = {}
    for impl in ("ragged", "dense"):
      model = _moe(cfg, impl)
      out[impl] = _forward_and_grad(model, x)
    (y_r, s_r, g_r), (y_d, s_d, g_d) = out["ragged"], out["dense"]
    self.assertEqual((y_r.shape, y_r.dtype), (x.shape, jnp.float32))
    _assert_close(self, y_r, y_d, 1e-5)
    jax.tree.map(np.testing.assert_array_equal, s_r, s_d)
    flat_r, flat_d = dict(nnx.to_flat_state(g_r)), dict(nnx.to_flat_state(g_d))
    self.assertEqual(set(flat_r), set(flat_d))
    self.assertEqual(("shared", "gate") in flat_r, num_shared_experts > 0)
    self.assertEqual(("latent_down",) in flat_r, latent_dim > 0)
    for path, g in flat_r.items():
      _assert_close(self, g[...], flat_d[path][...], 1e-5)
    self.assertGreater(float(jnp.max(jnp.abs(flat_r[("router",)][...]))), 0.0)

  def test_bfloat16_compute(self):
    cfg = _cfg(latent_dim=16)
    x = _x(dtype=jnp.bfloat16)
    ys = {}
    for impl in ("ragged", "dense"):
      model = _moe(cfg, impl, dtype="bfloat16")
      ys[impl] = _forward(model, x)[0]
      self.assertEqual(model.w_gate[...].dtype, jnp.float32)
    self.assertEqual(ys["ragged"].dtype, jnp.bfloat16)
    _assert_close(self, ys["ragged"].astype(jnp.float32), ys["dense"].astype(jnp.float32), 2e-2)

  @parameterized.parameters("zeros", "one_hot")
  def test_maximally_skewed_router(self, kind):
    cfg = _cfg()
    x = _x().at[..., 0].set(1.0)
    m = x.shape[0] * x.shape[1]
    out = {}
    for impl in ("ragged", "dense"):
      model = _moe(cfg, impl)
      router = jnp.zeros((D, 8))
      if kind == "one_hot":  # expert 5 wins every token: s_5 = sigmoid(100), the rest 1/2
        router = router.at[0, 5].set(100.0)
      model.router[...] = router
      out[impl] = _forward_and_grad(model, x)
    (y_r, s_r, g_r), (y_d, _, _) = out["ragged"], out["dense"]
    _assert_close(self, y_r, y_d, 1e-5)
    self.assertTrue(all(bool(jnp.all(jnp.isfinite(g[...]))) for _, g in nnx.to_flat_state(g_r)))
    load = np.asarray(s_r["load"])
    self.assertEqual(load.sum(), 2 * m)
    hot = [0, 1] if kind == "zeros" else [0, 5]   # ties at 1/2: top_k takes the lowest ids
    np.testing.assert_array_equal(load[hot], m)
    self.assertGreater(float(max_violation(s_r["load"])), 2.0)
    new_bias = update_bias(jnp.zeros(8), s_r, cfg)
    self.assertTrue(bool(jnp.all(jnp.isfinite(new_bias))))
    if kind == "one_hot":  # the hot expert is pushed down
      self.assertEqual(int(jnp.argmin(new_bias)), 5)


class MoEStatsTest(parameterized.TestCase):

  def _model(self, **kw):
    return _moe(_cfg(**kw))

  def test_padding_excluded_from_stats(self):
    model = self._model()
    x = _x(b=2, t=12)
    mask = jnp.arange(24).reshape(2, 12) % 4 != 3
    _, stats, _ = _forward(model, x, mask)
    _, stats_valid, _ = model(x[mask][None])       # only the valid tokens, as one row
    self.assertEqual(set(stats), {"load", "dropped", "qb_hist"})
    for key in stats:
      self.assertEqual(stats[key].dtype, jnp.int32)
      np.testing.assert_array_equal(stats[key], stats_valid[key])
    self.assertEqual(int(stats["load"].sum()), 18 * 2)
    self.assertEqual(stats["qb_hist"].shape, (8, 64))

  def test_stats_additive_over_microbatches(self):
    model = self._model()
    x = _x(b=4, t=12)
    _, whole, _ = _forward(model, x)
    _, a, _ = _forward(model, x[:2])
    _, b, _ = _forward(model, x[2:])
    jax.tree.map(lambda w, p, q: np.testing.assert_array_equal(w, p + q), whole, a, b)

  def test_no_histogram_without_qb(self):
    _, stats, _ = _forward(self._model(balancing="sign"), _x())
    self.assertEqual(set(stats), {"load", "dropped"})
    self.assertEqual(int(stats["dropped"]), 0)

  def test_update_bias_qb_equals_histogram_method(self):
    cfg = _cfg(qb_num_bins=256)
    model = _moe(cfg)
    model.bias[...] = 0.05 * jax.random.normal(jax.random.PRNGKey(7), (8,))
    x = _x(b=4, t=12)
    _, stats, _ = _forward(model, x)
    new = update_bias(model.bias[...], stats, cfg)
    scores = jax.nn.sigmoid(x.reshape(-1, D) @ model.router[...])
    ref = quantile_balance(scores, model.bias[...], 2, method="histogram", num_bins=256)
    np.testing.assert_allclose(new, ref, atol=1e-5)
    self.assertLess(abs(float(jnp.mean(new))), 1e-6)

  def test_update_bias_sign_and_none(self):
    bias = jnp.linspace(-0.1, 0.1, 8)
    stats = {"load": jnp.array([9, 1, 2, 2, 2, 2, 2, 12], jnp.int32),
             "dropped": jnp.array(8, jnp.int32)}
    sign = update_bias(bias, stats, _cfg(balancing="sign", sign_gamma=0.01))
    np.testing.assert_allclose(sign - bias, [-0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, -0.01],
                               atol=1e-7)
    np.testing.assert_array_equal(update_bias(bias, stats, _cfg(balancing="none")), bias)
    metrics = layer_metrics(bias, stats)
    np.testing.assert_allclose(metrics["max_vio"], 12 / 4 - 1)
    np.testing.assert_allclose([metrics["bias_min"], metrics["bias_max"]], [-0.1, 0.1])
    np.testing.assert_allclose(metrics["drop_frac"], 8 / 32)
    np.testing.assert_array_equal(metrics["load"], stats["load"])

  def test_balancing_loop_reduces_max_vio(self):
    # A skewed router on a fixed batch: a few QB updates through the layer balance it.
    cfg = _cfg(num_experts=16, experts_per_token=2, qb_num_bins=500)
    model = _moe(cfg)
    # x_0 = 1 on every token, so router row 0 acts as a per-expert logit offset.
    model.router[...] = model.router[...].at[0].set(jnp.linspace(-1.5, 1.5, 16))
    x = _x(b=8, t=64).at[..., 0].set(1.0)
    vio = []
    for _ in range(4):
      stats = _forward(model, x)[1]
      vio.append(float(max_violation(stats["load"])))
      model.bias[...] = update_bias(model.bias[...], stats, cfg)
    self.assertLess(vio[-1], 0.25 * vio[0], vio)


class _Block(nnx.Module):
  def __init__(self, cfg, seed):
    self.ffn = _moe(cfg, seed=seed)


class _TwoMoE(nnx.Module):
  """Two MoE layers at the model's paths layers/{0,1}/ffn (the bias-state structure)."""

  def __init__(self, cfg):
    self.layers = nnx.List([_Block(cfg, 0), _Block(cfg, 1)])


class _Recorder:
  """A plan's moe_dispatch that runs the local ragged path and records that it was called."""

  calls = 0

  def __call__(self, x, routes, bias, valid, w_gate, w_up, w_down, *, cfg, glu, dtype, rows):
    type(self).calls += 1
    assert rows == x.shape[0] // _x().shape[1], rows  # the [B, T] batch's B
    from hybridmoe_jax.layers.balancing import routing_stats  # pylint: disable=g-import-not-at-top
    from hybridmoe_jax.layers.moe import _ragged_experts  # pylint: disable=g-import-not-at-top
    y = _ragged_experts(x, routes.experts, routes.weights, w_gate, w_up, w_down, glu, dtype)
    return y, routing_stats(routes, bias, valid, cfg, dropped=jnp.asarray(3, jnp.int32))


class BalancingTest(parameterized.TestCase):

  @parameterized.parameters("qb", "sign", "none")
  def test_update_is_one_tree_map_over_biases_and_stats(self, balancing):
    cfg = _cfg(balancing=balancing, sign_gamma=0.01)
    model = _TwoMoE(cfg)
    model.layers[1].ffn.bias[...] = 0.02 * jnp.arange(8.0)
    _, biases, _ = nnx.split(model, RoutingBias, ...)
    x = _x(b=2, t=12)
    stats = {"layers": {i: {"ffn": {"bias": _forward(model.layers[i].ffn, x * (i + 1))[1]}}
                        for i in range(2)}}
    new, metrics = jax.jit(lambda b, s: update_routing_biases(b, s, cfg))(biases, stats)
    self.assertEqual(jax.tree.structure(new), jax.tree.structure(biases))
    self.assertEqual(set(metrics), {"layers/0/ffn", "layers/1/ffn"})
    for i in range(2):
      old = biases["layers"][i]["ffn"]["bias"][...]
      s = stats["layers"][i]["ffn"]["bias"]
      np.testing.assert_allclose(new["layers"][i]["ffn"]["bias"][...], update_bias(old, s, cfg),
                                 atol=1e-7)
      jax.tree.map(np.testing.assert_allclose, metrics[f"layers/{i}/ffn"],
                   layer_metrics(old, s))
    # The input state is untouched (the step keeps it for a skipped update).
    np.testing.assert_array_equal(biases["layers"][1]["ffn"]["bias"][...], 0.02 * jnp.arange(8.0))
    if balancing != "none":
      self.assertFalse(np.allclose(new["layers"][0]["ffn"]["bias"][...], 0.0))

  def test_dispatch_replaces_the_local_experts(self):
    cfg = _cfg()
    x = _x()
    ref_y, ref_stats, _ = _moe(cfg)(x)
    with execution_plan(ExecutionPlan(moe_dispatch=_Recorder())):
      y, stats, _ = _moe(cfg)(x)
    self.assertEqual(_Recorder.calls, 1)
    _assert_close(self, y, ref_y, 1e-6)
    np.testing.assert_array_equal(stats["load"], ref_stats["load"])
    self.assertEqual(int(stats["dropped"]), 3)

  def test_dense_impl_refuses_a_dispatch(self):
    with self.assertRaisesRegex(ValueError, "compute.moe_impl='dense'"):
      with execution_plan(ExecutionPlan(moe_dispatch=_Recorder())):
        _moe(_cfg(), "dense")(_x())


class BiasStateTest(absltest.TestCase):

  def test_bias_is_not_a_param_and_gets_no_gradient(self):
    model = _moe(_cfg(latent_dim=16))
    self.assertIsInstance(model.bias, RoutingBias)
    self.assertNotIsInstance(model.bias, nnx.Param)
    self.assertNotIn(("bias",), dict(nnx.to_flat_state(nnx.state(model, nnx.Param))))
    x = _x()
    model.bias[...] = 0.1 * jnp.arange(8.0)
    graphdef, bias_state, rest = nnx.split(model, RoutingBias, ...)
    grad = jax.jit(jax.grad(lambda b: _loss(nnx.merge(graphdef, b, rest), x)))(bias_state)
    np.testing.assert_array_equal(grad["bias"][...], 0.0)

  def test_optimizer_skips_bias(self):
    model = _moe(_cfg())
    model.bias[...] = 0.1 * jnp.arange(8.0)
    opt = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.1), wrt=nnx.Param)
    paths = [p for p, _ in nnx.to_flat_state(nnx.state(opt, nnx.OptState))]
    self.assertTrue(paths)
    self.assertFalse([p for p in paths if "bias" in p], paths)

    @nnx.jit
    def train_step(model, opt, x):
      opt.update(model, nnx.grad(_loss)(model, x))

    train_step(model, opt, _x())
    np.testing.assert_array_equal(model.bias[...], 0.1 * jnp.arange(8.0))


class GLUMLPTest(parameterized.TestCase):

  @parameterized.parameters("situ", "swiglu")
  def test_formula(self, glu):
    from hybridmoe_jax.ops.glu import get_glu
    mlp = GLUMLP(D, 48, glu=glu, dtype="float32", rngs=nnx.Rngs(0))
    x = _x()
    ref = get_glu(glu)(x @ mlp.gate[...], x @ mlp.up[...]) @ mlp.down[...]
    np.testing.assert_allclose(mlp(x), ref, rtol=1e-5, atol=1e-6)
    self.assertEqual(mlp.gate[...].shape, (D, 48))
    np.testing.assert_allclose(jnp.std(mlp.gate[...]), D ** -0.5, rtol=0.1)


if __name__ == "__main__":
  absltest.main()
