"""train/muon.py against optax.contrib.muon (the reference), and its sharding on a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from optax.contrib import MuonDimensionNumbers
from optax.contrib import muon as optax_muon

from hybridmoe_jax.train import muon, optim


def _tree(seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  return {"w": jax.random.normal(k[0], (12, 20)),           # 2-D, output axis wider
          "tall": jax.random.normal(k[1], (24, 8)),         # 2-D, reduction axis wider
          "experts": jax.random.normal(k[2], (3, 16, 6)),   # stacked experts [E, d, f]
          "stack": jax.random.normal(k[3], (2, 3, 8, 10)),  # scanned repeats [R, E, d, f]
          "norm": jax.random.normal(k[4], (16,))}           # AdamW


def _dims(params):
  return jax.tree.map(lambda x: None if x.ndim < 2 else
                      MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1),
                      params)


def _run(tx, params, steps=3):
  state = tx.init(params)
  for i in range(steps):
    grads = jax.tree.map(lambda x: jnp.sin(x * (i + 1)), params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_updates_equal_optax_muon():
  """Weight decay 0: optax decays AdamW leaves without a mask; ours masks them (below)."""
  params = _tree()
  ours = _run(muon.muon(1e-2, _dims, lambda p: jax.tree.map(lambda _: True, p), b1=0.9,
                        b2=0.95, weight_decay=0.0), params)
  ref = _run(optax_muon(1e-2, adam_b1=0.9, adam_b2=0.95, muon_weight_dimension_numbers=_dims,
                        consistent_rms=0.2), params)
  for k in params:
    np.testing.assert_allclose(ours[k], ref[k], rtol=2e-5, atol=2e-6, err_msg=k)


def test_orthogonalize_gives_near_orthogonal_rows():
  x = jax.random.normal(jax.random.key(1), (2, 3, 8, 32))
  o = muon.orthogonalize(x)
  s = jnp.linalg.svd(o, compute_uv=False)
  assert o.shape == x.shape and o.dtype == jnp.float32
  assert float(s.min()) > 0.5 and float(s.max()) < 1.3   # the quintic's band around 1


def test_weight_decay_follows_the_mask():
  params = {"w": jnp.ones((8, 8)), "norm": jnp.ones((8,))}
  tx = optim.make_optimizer(optim_cfg(), lambda _: 1.0)
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, state, params)
  assert float(jnp.abs(updates["norm"]).max()) == 0.0       # no decay on vectors
  assert float(updates["w"][0, 0]) == pytest.approx(-0.1)   # lr 1 x weight decay 0.1


def optim_cfg():
  from hybridmoe_jax.config.run import TrainConfig  # pylint: disable=g-import-not-at-top
  return TrainConfig(optimizer="muon", weight_decay=0.1, clip=0.0)


def test_a_sharded_expert_stack_stays_sharded():
  """The Gram matrices of an expert stack split over 8 devices stay split: optax's reshape
  of [R, E] into one axis gathers the stack on every device."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (host) devices")
  mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))  # as the step
  sharding = NamedSharding(mesh, P(None, "expert", None, None))
  x = jax.device_put(jnp.ones((4, 64, 96, 128)), sharding)

  def temp(fn):
    return jax.jit(fn, out_shardings=sharding).lower(x).compile().memory_analysis() \
        .temp_size_in_bytes

  ours = temp(muon.orthogonalize)
  ref = temp(lambda v: optax.contrib._muon.orthogonalize_via_newton_schulz(  # pylint: disable=protected-access
      v, jnp.asarray(muon.NS_COEFFS), dimension_numbers=MuonDimensionNumbers(2, 3)))
  whole = x.size * 4
  assert ours < whole / 8 <= ref, (ours, ref, whole)
