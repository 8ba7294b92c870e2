"""Tests of Quantile Balancing and the sign-rule baseline (DESIGN s4.2)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from hybridmoe_jax.ops.quantile_balance import (bias_from_histogram, qb_histogram, qb_range,
                                                quantile_balance, sign_rule_update)
from hybridmoe_jax.ops.routing import expert_load, max_violation, sigmoid_topk_route


def _batch(m, e, seed=0, skew=0.3, bias_scale=0.1):
  """scores [m, E] = sigmoid(z + skew * per-expert offset), a random old bias [E]."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  logits = jax.random.normal(k1, (m, e)) + skew * jax.random.normal(k2, (e,))
  return jax.nn.sigmoid(logits), bias_scale * jax.random.normal(k3, (e,))


def _residuals(scores, bias, k):
  """r = alpha - s, alpha = (k+1)-th largest of s + b: numpy, same fp32 arithmetic as the op."""
  s, b = np.asarray(scores, np.float32), np.asarray(bias, np.float32)
  alpha = np.sort(s + b, axis=1)[:, -(k + 1)]
  return alpha[:, None] - s


def _check_counts(test, r, b, n):
  """#{r_ij < b_j} == n per expert, up to ties in r.

  Ties are real: the token whose (k+1)-th expert is j has r_ij = alpha_i - s_ij = b_old_j, so
  r[:, j] holds a cluster of (near-)equal values at the old bias. If n falls inside it, no
  threshold splits the cluster; then b must sit at the cluster (#{r < b} <= n <= #{r <= b}).
  """
  b = np.asarray(b, np.float32)[None]
  below, at_or_below = (r < b).sum(0), (r <= b).sum(0)
  r_sorted = np.sort(r, axis=0)
  lo_n, hi_n = int(np.floor(n)), int(np.ceil(n))
  gap = r_sorted[hi_n] - r_sorted[max(lo_n - 1, 0)]     # spacing around the target position
  tie_free = gap > 1e-6
  test.assertGreater(tie_free.mean(), 0.5)
  test.assertTrue(np.all((below[tie_free] >= lo_n) & (below[tie_free] <= hi_n)),
                  (below[tie_free], n))
  np.testing.assert_array_less(below - 1, np.ceil(n))   # below <= ceil(n)
  np.testing.assert_array_less(np.floor(n), at_or_below + 1)   # at_or_below >= floor(n)
  return below, tie_free


class ExactQBTest(parameterized.TestCase):

  @parameterized.parameters(dict(m=512, e=64, k=4), dict(m=448, e=32, k=6),
                            dict(m=1000, e=8, k=2))
  def test_exact_count_below_bias(self, m, e, k):
    scores, bias = _batch(m, e)
    n = m * k // e
    self.assertEqual(n * e, m * k)  # integer target
    b = quantile_balance(scores, bias, k, centre=False)
    # With the cutoffs fixed, token i picks j iff r_ij < b_j: exactly n tokens per expert.
    below, tie_free = _check_counts(self, _residuals(scores, bias, k), b, n)
    np.testing.assert_array_equal(below[tie_free], n)
    centred = quantile_balance(scores, bias, k)
    np.testing.assert_allclose(centred, b - jnp.mean(b), atol=1e-6)
    self.assertLess(abs(float(jnp.mean(centred))), 1e-6)

  def test_non_integer_target_rounds(self):
    scores, bias = _batch(500, 16)
    b = quantile_balance(scores, bias, 3, centre=False)      # n = 93.75
    _check_counts(self, _residuals(scores, bias, 3), b, 93.75)

  def test_mask_equals_dropping_tokens(self):
    scores, bias = _batch(600, 16)
    mask = jnp.arange(600) % 3 != 0                          # 400 valid, n = 400*4/16 = 100
    b_mask = quantile_balance(scores, bias, 4, mask=mask, centre=False)
    b_sub = quantile_balance(scores[mask], bias, 4, centre=False)
    np.testing.assert_allclose(b_mask, b_sub, rtol=1e-6)
    below, tie_free = _check_counts(self, _residuals(scores[mask], bias, 4), b_mask, 100)
    np.testing.assert_array_equal(below[tie_free], 100)

  def test_no_valid_tokens_keeps_bias(self):
    scores, bias = _batch(64, 8)
    for method in ("exact", "histogram"):
      b = quantile_balance(scores, bias, 2, mask=jnp.zeros(64, bool), method=method)
      np.testing.assert_array_equal(b, bias)

  def test_jit_and_no_gradient(self):
    scores, bias = _batch(128, 16)
    for method in ("exact", "histogram"):
      f = jax.jit(functools.partial(quantile_balance, k=2, method=method, num_bins=64))
      np.testing.assert_allclose(f(scores, bias), quantile_balance(scores, bias, 2,
                                                                   method=method, num_bins=64),
                                 atol=1e-6)
      g = jax.grad(lambda s, b: jnp.sum(f(s, b) ** 2), argnums=(0, 1))(scores, bias)
      for leaf in g:
        np.testing.assert_array_equal(leaf, 0.0)


class HistogramQBTest(parameterized.TestCase):

  def test_range_contains_residuals(self):
    scores, bias = _batch(256, 16, bias_scale=2.0)
    lo, hi = qb_range(bias)
    r = _residuals(scores, bias, 3)
    self.assertTrue(np.all((r > float(lo)) & (r < float(hi))))
    hist = qb_histogram(scores, bias, 3, 100)
    self.assertEqual((hist.shape, hist.dtype), ((16, 100), jnp.int32))
    np.testing.assert_array_equal(hist.sum(1), 256)

  @parameterized.parameters(dict(m=4096, e=64, k=4, bins=1000), dict(m=2048, e=32, k=8, bins=200))
  def test_within_one_bin_of_exact(self, m, e, k, bins):
    scores, bias = _batch(m, e, seed=1)
    exact = quantile_balance(scores, bias, k, centre=False)
    hist = quantile_balance(scores, bias, k, method="histogram", num_bins=bins, centre=False)
    lo, hi = qb_range(bias)
    width = float(hi - lo) / bins
    np.testing.assert_array_less(np.abs(np.asarray(hist - exact)), width)

  def test_additive_over_microbatches(self):
    scores, bias = _batch(1000, 32)
    mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (1000,))
    whole = qb_histogram(scores, bias, 4, 128, mask)
    parts = sum(qb_histogram(scores[i:i + 250], bias, 4, 128, mask[i:i + 250])
                for i in range(0, 1000, 250))
    np.testing.assert_array_equal(whole, parts)
    np.testing.assert_array_equal(whole.sum(1), int(mask.sum()))
    # The pooled histogram gives the same bias as the whole batch's.
    target = float(mask.sum()) * 4 / 32
    np.testing.assert_allclose(bias_from_histogram(parts, *qb_range(bias), target),
                               quantile_balance(scores, bias, 4, method="histogram",
                                                num_bins=128, mask=mask), atol=1e-6)

  def test_bias_from_histogram_interpolates(self):
    hist = jnp.array([[2, 2, 0, 4], [0, 0, 3, 5], [8, 0, 0, 0]], jnp.int32)
    b = bias_from_histogram(hist, jnp.float32(0.0), jnp.float32(4.0), 3.0)
    raw = np.array([1.5, 3.0, 3 / 8])   # cum reaches 3 inside bin 1, at the end of 2, in bin 0
    np.testing.assert_allclose(b, raw - raw.mean(), rtol=1e-6)


def _skewed_batch():
  """E=896, k=16, m=4096 scores with per-expert offsets: MaxVio ~7 at bias 0."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return jax.random.normal(k1, (4096, 896)) + 0.32 * jax.random.normal(k2, (896,))


class ConvergenceTest(absltest.TestCase):
  """On one fixed skewed batch QB balances in a few updates; the sign rule needs ~100."""

  def test_qb_vs_sign_rule(self):
    logits, k, e = _skewed_batch(), 16, 896
    scores = jax.nn.sigmoid(logits)
    route_load = lambda b: expert_load(sigmoid_topk_route(logits, b, k).experts, e)

    def run(update, steps):
      def step(b, _):
        load = route_load(b)
        return update(b, load), max_violation(load)
      b, vios = jax.lax.scan(step, jnp.zeros(e), None, length=steps)
      return np.append(np.asarray(vios), float(max_violation(route_load(b))))

    exact = run(lambda b, _: quantile_balance(scores, b, k), 3)
    hist = run(lambda b, _: quantile_balance(scores, b, k, method="histogram"), 3)
    sign = run(lambda b, load: sign_rule_update(load, b, 1e-3), 50)
    curves = f"exact {exact.round(3)}\nhistogram {hist.round(3)}\nsign {sign[::10].round(3)}"
    print(curves)
    self.assertGreater(exact[0], 6.0, curves)
    self.assertLess(exact[-1], 0.1, curves)
    self.assertLess(hist[-1], 0.1, curves)
    self.assertGreater(sign[-1], 1.0, curves)


class SignRuleTest(absltest.TestCase):

  def test_sign_rule(self):
    b = sign_rule_update(jnp.array([10, 5, 0, 5]), jnp.array([0.0, 0.1, 0.2, 0.3]), 1e-3)
    np.testing.assert_allclose(b, [-1e-3, 0.1, 0.201, 0.3], rtol=1e-6)


class BadArgumentsTest(parameterized.TestCase):
  """k outside 0 < k < E or zero bins: refused naming the argument, never a NaN bias or a
  top_k error about k + 1."""

  @parameterized.parameters(0, 4, 5)
  def test_k_outside_range_raises(self, k):
    scores, bias = _batch(16, 4)
    for method in ("exact", "histogram"):
      with self.assertRaisesRegex(ValueError, f"0 < k < E.*k={k}, E=4"):
        quantile_balance(scores, bias, k, method=method)
    with self.assertRaisesRegex(ValueError, f"0 < k < E.*k={k}, E=4"):
      qb_histogram(scores, bias, k, 10)

  def test_k_equal_e_minus_one_is_accepted(self):
    scores, bias = _batch(16, 4)
    for method in ("exact", "histogram"):
      self.assertTrue(np.isfinite(quantile_balance(scores, bias, 3, method=method)).all())

  @parameterized.parameters(0, -1)
  def test_no_bins_raises(self, bins):
    scores, bias = _batch(16, 4)
    with self.assertRaisesRegex(ValueError, "num_bins must be an int >= 1"):
      quantile_balance(scores, bias, 2, method="histogram", num_bins=bins)


if __name__ == "__main__":
  absltest.main()
