"""Tests of the sigmoid top-k router and the GLU activations (DESIGN s4.1)."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from hybridmoe_jax.ops.glu import get_glu, situ_glu, swiglu
from hybridmoe_jax.ops.routing import (expert_load, max_violation, replay_route,
                                       sigmoid_topk_route, top_k_with_cutoff)


def _inputs(m, e, seed=0, bias_scale=0.3):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.normal(k1, (m, e)), bias_scale * jax.random.normal(k2, (e,))


class GLUTest(parameterized.TestCase):

  def test_situ_is_bounded_by_100(self):
    big = jnp.array([-1e30, -1e4, -30.0, 0.0, 30.0, 1e4, 1e30, jnp.inf, -jnp.inf])
    g, u = jnp.meshgrid(big, big)
    f = situ_glu(g, u)
    self.assertEqual(f.dtype, jnp.float32)
    self.assertTrue(bool(jnp.all(jnp.isfinite(f))))
    self.assertLessEqual(float(jnp.max(jnp.abs(f))), 100.0)
    # The bound is reached: gate branch -> 4, up branch -> 25.
    np.testing.assert_allclose(situ_glu(jnp.float32(1e4), jnp.float32(1e4)), 100.0, rtol=1e-6)

  def test_situ_matches_swiglu_near_zero(self):
    # tanh(x/c) c = x - x^3/(3c^2) + ..., so for small g, u:
    # situ(g, u) = g sigmoid(g) u (1 + O(g^2/48 + u^2/1875)) = swiglu(g, u) (1 + O(2e-4)).
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    g = jax.random.uniform(k1, (1000,), minval=-0.1, maxval=0.1)
    u = jax.random.uniform(k2, (1000,), minval=-0.1, maxval=0.1)
    np.testing.assert_allclose(situ_glu(g, u), swiglu(g, u), rtol=3e-4, atol=1e-9)
    dsitu = jax.grad(lambda g: jnp.sum(situ_glu(g, u)))(g)
    dswi = jax.grad(lambda g: jnp.sum(swiglu(g, u)))(g)
    np.testing.assert_allclose(dsitu, dswi, rtol=1e-3, atol=1e-7)

  @parameterized.parameters("situ", "swiglu")
  def test_fp32_output_from_bf16(self, kind):
    g = jnp.linspace(-3, 3, 16, dtype=jnp.bfloat16)
    f = get_glu(kind)(g, g)
    self.assertEqual(f.dtype, jnp.float32)
    ref = get_glu(kind)(g.astype(jnp.float32), g.astype(jnp.float32))
    np.testing.assert_allclose(f, ref, rtol=1e-6)

  def test_swiglu_formula(self):
    g = jnp.linspace(-5, 5, 11)
    np.testing.assert_allclose(swiglu(g, 2 * g), g / (1 + np.exp(-g)) * 2 * g, rtol=1e-6)

  def test_unknown_glu_raises(self):
    with self.assertRaises(ValueError):
      get_glu("gelu")


class RoutingTest(parameterized.TestCase):

  @parameterized.parameters(dict(m=64, e=8, k=2), dict(m=33, e=16, k=5), dict(m=128, e=64, k=8))
  def test_matches_numpy(self, m, e, k):
    logits, bias = _inputs(m, e)
    r = sigmoid_topk_route(logits, bias, k, routed_scale=2.5)
    self.assertEqual((r.experts.shape, r.experts.dtype), ((m, k), jnp.int32))
    self.assertEqual((r.weights.shape, r.weights.dtype), ((m, k), jnp.float32))
    self.assertEqual((r.scores.shape, r.cutoff.shape), ((m, e), (m,)))
    s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    biased = s + np.asarray(bias)
    order = np.argsort(-biased, axis=1)
    np.testing.assert_array_equal(np.sort(r.experts, 1), np.sort(order[:, :k], 1))
    np.testing.assert_allclose(r.cutoff, np.sort(biased, 1)[:, -(k + 1)], rtol=1e-6)
    # Weights from the unbiased scores of the chosen experts only: the bias never enters.
    chosen = np.take_along_axis(s, np.asarray(r.experts), 1)
    np.testing.assert_allclose(r.weights, chosen / chosen.sum(1, keepdims=True) * 2.5,
                               rtol=1e-5)
    # renormalize=False (Kimi-Linear's moe_renormalize=false, or top-1): the scores as they
    # are, same routes.
    raw = sigmoid_topk_route(logits, bias, k, routed_scale=2.5, renormalize=False)
    np.testing.assert_array_equal(raw.experts, r.experts)
    np.testing.assert_allclose(raw.weights, chosen * 2.5, rtol=1e-6)

  def test_bias_changes_routes_not_weights(self):
    logits, bias = _inputs(256, 16, bias_scale=0.05)
    r0 = sigmoid_topk_route(logits, jnp.zeros(16), 4)
    r1 = sigmoid_topk_route(logits, bias, 4)
    same = np.all(np.sort(r0.experts, 1) == np.sort(r1.experts, 1), axis=1)
    self.assertGreater(same.sum(), 0)
    self.assertLess(same.sum(), 256)  # the bias did move some routes
    w0 = np.take_along_axis(np.asarray(r0.weights), np.argsort(r0.experts, 1), 1)
    w1 = np.take_along_axis(np.asarray(r1.weights), np.argsort(r1.experts, 1), 1)
    np.testing.assert_allclose(w0[same], w1[same], rtol=1e-6)

  def test_no_gradient_to_bias(self):
    logits, bias = _inputs(32, 8)
    f = lambda lg, b: jnp.sum(jnp.sin(sigmoid_topk_route(lg, b, 3).weights))
    g_logits, g_bias = jax.grad(f, argnums=(0, 1))(logits, bias)
    np.testing.assert_array_equal(g_bias, 0.0)
    self.assertGreater(float(jnp.max(jnp.abs(g_logits))), 0.0)

  def test_top_k_with_cutoff(self):
    x, _ = _inputs(50, 12)
    idx, cut = jax.jit(top_k_with_cutoff, static_argnums=1)(x, 4)
    xs = np.sort(np.asarray(x), 1)[:, ::-1]
    np.testing.assert_allclose(np.take_along_axis(np.asarray(x), np.asarray(idx), 1), xs[:, :4])
    np.testing.assert_allclose(cut, xs[:, 4])

  def test_k_must_be_below_e(self):
    logits, bias = _inputs(4, 4)
    with self.assertRaises(ValueError):
      sigmoid_topk_route(logits, bias, 4)

  def test_load_and_max_violation(self):
    experts = jnp.array([[0, 1], [0, 2], [0, 3], [1, 2]], jnp.int32)
    np.testing.assert_array_equal(expert_load(experts, 4), [3, 2, 2, 1])
    mask = jnp.array([True, True, False, True])
    np.testing.assert_array_equal(expert_load(experts, 4, mask), [2, 2, 2, 0])
    np.testing.assert_allclose(max_violation(jnp.array([3, 2, 2, 1])), 3 / 2 - 1)
    self.assertEqual(float(max_violation(jnp.array([5, 5, 5]))), 0.0)
    self.assertEqual(float(max_violation(jnp.zeros(4, jnp.int32))), 0.0)


class ReplayRouteTest(parameterized.TestCase):

  @parameterized.parameters(dict(renormalize=True, bias_scale=0.3),
                            dict(renormalize=False, bias_scale=0.0))
  def test_replaying_top_k_gives_the_same_routes(self, renormalize, bias_scale):
    logits, bias = _inputs(40, 8, seed=3, bias_scale=bias_scale)
    ref = sigmoid_topk_route(logits, bias, 3, routed_scale=2.5, renormalize=renormalize)
    got = replay_route(logits, ref.experts, bias=bias, routed_scale=2.5,
                       renormalize=renormalize)
    for field in ref._fields:
      np.testing.assert_array_equal(getattr(got, field), getattr(ref, field), err_msg=field)

  def test_other_experts_weights_cutoff_and_gradient(self):
    logits, bias = _inputs(6, 5, seed=4)
    experts = jnp.array([[4, 0], [1, 2], [3, 4], [0, 1], [2, 3], [4, 1]], jnp.int32)
    r = replay_route(logits, experts, bias=bias, routed_scale=1.5)
    np.testing.assert_array_equal(r.experts, experts)
    s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    chosen = np.take_along_axis(s, np.asarray(experts), 1)
    np.testing.assert_allclose(r.weights, chosen / chosen.sum(1, keepdims=True) * 1.5,
                               rtol=1e-6)
    left_out = np.where(np.eye(5, dtype=bool)[np.asarray(experts)].any(1), -np.inf,
                        s + np.asarray(bias))
    np.testing.assert_allclose(r.cutoff, left_out.max(1), rtol=1e-6)
    f = lambda lg: jnp.sum(jnp.sin(3.0 * replay_route(lg, experts).weights))
    g = np.asarray(jax.grad(f)(logits))
    # Only the replayed experts' logits get a gradient.
    self.assertTrue(np.all(g[~np.eye(5, dtype=bool)[np.asarray(experts)].any(1)] == 0.0))
    self.assertGreater(float(np.min(np.abs(np.take_along_axis(g, np.asarray(experts), 1)))),
                       0.0)

  def test_bad_experts_raise(self):
    logits, _ = _inputs(4, 6)
    for bad in (jnp.zeros((4,), jnp.int32), jnp.zeros((3, 2), jnp.int32),
                jnp.zeros((4, 6), jnp.int32), jnp.zeros((4, 2), jnp.float32)):
      with self.assertRaisesRegex(ValueError, "experts must be integer"):
        replay_route(logits, bad)


if __name__ == "__main__":
  absltest.main()
