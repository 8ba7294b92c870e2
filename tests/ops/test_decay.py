"""Tests for the KDA gates (DESIGN s1.2)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridmoe_jax.ops import bounded_log_decay, unbounded_log_decay
from hybridmoe_jax.ops.kda import kda

HV, K = 3, 8


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(2, 5, HV, K)) * 2.0).astype(np.float32)
  a_log = rng.normal(size=(HV,)).astype(np.float32) * 0.5
  dt_bias = rng.normal(size=(HV * K,)).astype(np.float32)
  return x, a_log, dt_bias


def _softplus(x):
  return np.logaddexp(0.0, x)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("lb", [-5.0, -1.0, -0.25])
def test_bounded_in_open_interval(lb):
  x, a_log, dt_bias = _inputs()
  # Moderate inputs: in fp32, sigmoid rounds to exactly 1 beyond ~17 (g == lb there).
  for kw in ({}, {"a_log": a_log}, {"a_log": a_log, "dt_bias": dt_bias},
             {"dt_bias": dt_bias.reshape(HV, K)}):
    g = np.asarray(bounded_log_decay(x, lower_bound=lb, **kw))
    assert g.dtype == np.float32 and g.shape == x.shape
    assert (g < 0).all() and (g > lb).all()


def test_bounded_matches_formula():
  x, a_log, dt_bias = _inputs(1)
  g = bounded_log_decay(x, lower_bound=-5.0, a_log=a_log, dt_bias=dt_bias)
  z = np.exp(a_log)[:, None] * (x.astype(np.float64) + dt_bias.reshape(HV, K))
  np.testing.assert_allclose(g, -5.0 * _sigmoid(z), rtol=1e-6, atol=1e-6)
  plain = bounded_log_decay(x, lower_bound=-2.0)
  np.testing.assert_allclose(plain, -2.0 * _sigmoid(x.astype(np.float64)), rtol=1e-6, atol=1e-6)


def test_bounded_extreme_inputs_stay_in_closed_range():
  x = np.array([-1e4, -100.0, 0.0, 100.0, 1e4], np.float32).reshape(1, 5, 1, 1)
  g = np.asarray(bounded_log_decay(np.broadcast_to(x, (1, 5, 1, 4)), lower_bound=-5.0))
  assert np.isfinite(g).all() and (g <= 0).all() and (g >= -5.0).all()


def test_unbounded_matches_formula():
  x, a_log, dt_bias = _inputs(2)
  g = unbounded_log_decay(x, a_log=a_log, dt_bias=dt_bias)
  ref = -np.exp(a_log)[:, None] * _softplus(x.astype(np.float64) + dt_bias.reshape(HV, K))
  assert np.asarray(g).dtype == np.float32
  np.testing.assert_allclose(g, ref, rtol=1e-6, atol=1e-6)
  assert (np.asarray(g) < 0).all()
  g0 = unbounded_log_decay(x, a_log=a_log)
  np.testing.assert_allclose(g0, -np.exp(a_log)[:, None] * _softplus(x.astype(np.float64)),
                             rtol=1e-6, atol=1e-6)


def test_unbounded_reaches_below_bounded_range():
  x, _, _ = _inputs(3)
  g = np.asarray(unbounded_log_decay(x, a_log=np.full((HV,), np.log(10.0), np.float32)))
  assert g.min() < -20.0  # why the bounded gate exists (see test_kda's block tests)


@pytest.mark.parametrize("lb", [-5.5, 0.0, 0.5, float("nan")])
def test_lower_bound_outside_range_raises(lb):
  x, _, _ = _inputs()
  with pytest.raises(ValueError, match=r"lower_bound must be in \[-5.0, 0\)"):
    bounded_log_decay(x, lower_bound=lb)


@pytest.mark.parametrize("lb", ["-5.0", b"-1", [-1.0]])
def test_lower_bound_that_is_not_a_number_raises(lb):
  """A string parses with float() but every op computes with lb itself (kda's gate check
  compared a float with it: TypeError): refused up front, naming the argument."""
  x, _, _ = _inputs()
  with pytest.raises(ValueError, match=r"lower_bound must be a float in \[-5.0, 0\)"):
    bounded_log_decay(x, lower_bound=lb)
  g = np.full((1, 4, 1, 16), -1.0, np.float32)
  q = np.full((1, 4, 1, 16), 0.25, np.float32)
  with pytest.raises(ValueError, match=r"lower_bound must be a float in \[-5.0, 0\)"):
    kda(q, q, q, g, np.full((1, 4, 1), 0.5, np.float32), lower_bound=lb, impl="chunked")


def test_bad_parameter_shapes_raise():
  x, a_log, dt_bias = _inputs()
  with pytest.raises(ValueError, match="a_log"):
    bounded_log_decay(x, a_log=a_log[:2])
  with pytest.raises(ValueError, match="dt_bias"):
    unbounded_log_decay(x, a_log=a_log, dt_bias=dt_bias[:-1])


@pytest.mark.parametrize("shape", [(K, HV), (1, HV * K), (HV * K, 1)])
def test_dt_bias_of_the_right_size_but_wrong_shape_raises(shape):
  """A transposed [K, HV] (or padded-rank) dt_bias has HV*K entries but would pair channels
  with the wrong heads: refused, never reshaped."""
  x, a_log, dt_bias = _inputs()
  with pytest.raises(ValueError, match=r"dt_bias must have shape \[HV\*K\] or \[HV, K\]"):
    bounded_log_decay(x, dt_bias=dt_bias.reshape(shape))
  with pytest.raises(ValueError, match="dt_bias"):
    unbounded_log_decay(x, a_log=a_log, dt_bias=dt_bias.reshape(shape))
