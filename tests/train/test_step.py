"""Train/eval step: loss masking, grad accumulation, non-finite skip, bias outside the optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.train import optim, step as step_lib
from hybridmoe_jax.train.config import default_config
from hybridmoe_jax.train.state import create_train_state
from tests.train.train_fakes import FakeBias, FakeIterator, fake_fns, fake_model_config


def _setup(**train):
  config = default_config()
  config.train.update({**dict(steps=20, warmup=2, lr=1e-2), **train})
  cfg = fake_model_config()
  tx = optim.make_optimizer(config.train)
  graphdef, state = create_train_state(fake_fns(), cfg, tx, seed=0, remat="none")
  train_step = step_lib.make_train_step(graphdef, fake_fns(), cfg, config.train, tx)
  return config, cfg, tx, graphdef, state, train_step


def test_targets_stay_inside_segments():
  tokens = jnp.array([[5, 6, 7, 8, 9, 0]])
  seg = jnp.array([[1, 1, 2, 2, 2, 0]])
  targets, w = step_lib.next_token_targets(tokens, seg)
  np.testing.assert_array_equal(targets, [[6, 7, 8, 9, 0, 0]])
  # 5->6 ok; 6->7 crosses 1|2; 7->8, 8->9 ok; 9->pad ignored; pad ignored.
  np.testing.assert_array_equal(w, [[1, 0, 1, 1, 0, 0]])


def test_token_nll_matches_log_softmax():
  logits = jax.random.normal(jax.random.key(0), (2, 3, 7)).astype(jnp.bfloat16)
  targets = jnp.array([[1, 2, 3], [4, 5, 6]])
  nll = step_lib.token_nll(logits, targets)
  ref = -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                             targets[..., None], -1)[..., 0]
  assert nll.dtype == jnp.float32
  np.testing.assert_allclose(nll, ref, rtol=1e-6, atol=1e-6)


def test_loss_falls_and_bias_moves():
  _, _, _, _, state, train_step = _setup(lr=5e-2)
  it = FakeIterator(4, 16)
  losses = []
  for _ in range(15):
    state, m = train_step(state, next(it))
    losses.append(float(m["loss"]))
  assert losses[-1] < 0.7 * losses[0]
  assert int(state.step) == 15 and int(state.skipped) == 0
  assert float(jnp.abs(jax.tree.leaves(state.biases)[0]).sum()) > 0
  assert set(m["moe"]["layer_1"]) >= {"max_vio", "bias_min", "bias_max", "load", "drop_frac"}


def test_bias_is_not_optimized_and_gets_no_gradient():
  config, cfg, tx, graphdef, state, _ = _setup()
  bias_leaves = jax.tree.leaves(state.biases)
  assert len(bias_leaves) == 1
  # Not in the differentiated tree, hence not in the optimizer state.
  for path, _ in nnx.to_flat_state(state.params):
    assert "bias" not in [str(p) for p in path] or "head" in [str(p) for p in path]
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
  n_par = sum(x.size for x in jax.tree.leaves(state.params))
  assert n_opt == 2 * n_par                # AdamW mu + nu over params only
  # The gradient w.r.t. the bias is zero (stop_gradient inside the step).
  batch = next(FakeIterator(2, 8))

  def loss_of_bias(biases):
    return step_lib._forward_nll(graphdef, state.params, biases, state.rest,
                                 batch["tokens"], batch["segment_ids"])[0]

  g = jax.grad(loss_of_bias)(state.biases)
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g))


def test_grad_accumulation_matches_full_batch():
  _, _, _, _, s1, step1 = _setup(batch_size=4, grad_accum=1)
  _, _, _, _, s2, step2 = _setup(batch_size=4, grad_accum=2)
  batch = next(FakeIterator(4, 16))
  s1, m1 = step1(s1, batch)
  s2, m2 = step2(s2, batch)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-4)
  np.testing.assert_array_equal(m1["moe"]["layer_1"]["load"], m2["moe"]["layer_1"]["load"])
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(s1.biases), jax.tree.leaves(s2.biases)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_nonfinite_loss_skips_update_and_counts():
  _, _, _, _, state, train_step = _setup()
  batch = next(FakeIterator(4, 16))
  state, _ = train_step(state, batch)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state, state.biases))
  # Poison one parameter: loss and gradient become NaN.
  emb = state.params["embed"]["embedding"]
  bad = state.replace(params=jax.tree.map(lambda x: x, state.params))
  bad.params["embed"]["embedding"][...] = emb[...].at[0, 0].set(jnp.nan)
  batch["tokens"][:, 0] = 0
  poisoned = jax.tree.map(np.asarray, bad.params)
  new, m = train_step(bad, batch)
  assert not bool(m["finite"]) and int(new.skipped) == 1 and int(new.step) == 2
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(poisoned)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(before[1])):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(new.biases), jax.tree.leaves(before[2])):
    np.testing.assert_array_equal(a, b)


def test_eval_step_counts_targets():
  _, _, _, graphdef, state, _ = _setup()
  eval_step = step_lib.make_eval_step(graphdef)
  batch = next(FakeIterator(2, 16))
  nll, n = eval_step(state.params, state.biases, batch, state.rest)
  # Per row: 16 positions, 3 pads, one segment boundary and the last real token -> 11 targets.
  assert float(n) == 2 * 11
  assert np.isfinite(float(nll)) and float(nll) > 0


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_schedules(schedule):
  config = default_config()
  config.train.update(dict(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1, schedule=schedule,
                           decay_fraction=0.2))
  f = optim.make_schedule(config.train)
  assert float(f(0)) == 0.0 and abs(float(f(10)) - 1.0) < 1e-6
  end = {"cosine": 0.1, "wsd": 0.1, "constant": 1.0}[schedule]
  assert abs(float(f(100)) - end) < 1e-6
  if schedule == "wsd":
    assert float(f(79)) == 1.0 and float(f(90)) < 1.0


def test_muon_optimizer_runs():
  _, _, _, _, state, train_step = _setup(optimizer="muon")
  it = FakeIterator(4, 16)
  losses = []
  for _ in range(10):
    state, m = train_step(state, next(it))
    losses.append(float(m["loss"]))
  assert losses[-1] < losses[0]
