"""Train/eval step on a tiny real HybridLM: loss masking, grad accumulation, non-finite skip,
bias outside the optimizer, the balancing metrics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ComputeConfig
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.ops import cross_entropy
from hybridmoe_jax.train import optim, step as step_lib
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.config.run import default_config
from hybridmoe_jax.train.stage_plan import build_plan
from hybridmoe_jax.train.state import create_train_state
from tests._support import mini_model_config
from tests.train.train_fakes import FakeIterator

MOE = "layers/1/ffn"   # the tiny model's one MoE layer, as metrics["moe"] names it


@functools.lru_cache(maxsize=None)
def _compiled(**train):
  """(cfg, tx, graphdef, train_step) per train-section override: one compile each."""
  config = default_config()
  config.train.update({**dict(steps=20, warmup=2, lr=1e-2), **train})
  cfg = mini_model_config()
  run = run_config_from_dict(config)
  schedule = build_plan(run).schedule()
  tx = optim.make_optimizer(run.train, schedule)
  graphdef, _ = create_train_state(cfg, ComputeConfig(), tx, seed=0)
  return cfg, tx, graphdef, step_lib.make_train_step(
      graphdef, cfg, tx, grad_accum=run.train.grad_accum, schedule=schedule)


def _setup(**train):
  """-> cfg, graphdef, a fresh state (the step donates it), train_step."""
  cfg, tx, graphdef, train_step = _compiled(**train)
  _, state = create_train_state(cfg, ComputeConfig(), tx, seed=0)
  return cfg, graphdef, state, train_step


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
  nll = cross_entropy.token_nll(logits, targets)
  ref = -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                             targets[..., None], -1)[..., 0]
  assert nll.dtype == jnp.float32
  np.testing.assert_allclose(nll, ref, rtol=1e-6, atol=1e-6)


def test_loss_falls_and_bias_moves():
  _, _, state, train_step = _setup(lr=5e-2)
  it = FakeIterator(4, 16)
  losses = []
  for _ in range(15):
    old_bias = np.asarray(state.biases["layers"][1]["ffn"]["bias"][...])
    state, m = train_step(state, next(it))
    losses.append(float(m["loss"]))
  assert losses[-1] < 0.7 * losses[0]
  assert int(state.step) == 15 and int(state.skipped) == 0
  assert float(jnp.abs(jax.tree.leaves(state.biases)[0]).sum()) > 0
  layer = m["moe"][MOE]
  assert set(m["moe"]) == {MOE}
  assert set(layer) == {"max_vio", "bias_min", "bias_max", "load", "drop_frac"}
  # Metrics describe the step's routing: the load of its valid tokens (13 of 16 per row,
  # k = 1) and the bias it routed with (the old one), dropless on one device.
  assert int(np.sum(layer["load"])) == 4 * 13
  np.testing.assert_allclose([layer["bias_min"], layer["bias_max"]],
                             [old_bias.min(), old_bias.max()])
  load = np.asarray(layer["load"], np.float64)
  np.testing.assert_allclose(layer["max_vio"], load.max() / load.mean() - 1, rtol=1e-6)
  assert float(layer["drop_frac"]) == 0.0


def test_bias_is_not_optimized_and_gets_no_gradient():
  cfg, graphdef, state, _ = _setup()
  flat = nnx.to_flat_state(state.biases)
  assert [tuple(p) for p, _ in flat] == [("layers", 1, "ffn", "bias")]
  assert all(isinstance(v, RoutingBias) for _, v in flat)
  # Not in the differentiated tree, hence not in the optimizer state.
  assert not any(isinstance(v, RoutingBias) for _, v in nnx.to_flat_state(state.params))
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
  n_par = sum(x.size for x in jax.tree.leaves(state.params))
  assert n_opt == 2 * n_par                # AdamW mu + nu over params only
  # The gradient w.r.t. the bias is zero (stop_gradient inside the step).
  batch = next(FakeIterator(2, 8))

  def loss_of_bias(biases):
    return step_lib._forward_nll(graphdef, state.params, biases, state.rest,
                                 batch["tokens"], batch["segment_ids"])[0]

  g = jax.jit(jax.grad(loss_of_bias))(state.biases)   # jitted: op by op compiles every op
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g))


def test_grad_accumulation_matches_full_batch():
  _, _, s1, step1 = _setup(batch_size=4, grad_accum=1)
  _, _, s2, step2 = _setup(batch_size=4, grad_accum=2)
  batch = next(FakeIterator(4, 16))
  s1, m1 = step1(s1, batch)
  s2, m2 = step2(s2, batch)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-4)
  np.testing.assert_array_equal(m1["moe"][MOE]["load"], m2["moe"][MOE]["load"])
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(s1.biases), jax.tree.leaves(s2.biases)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_nonfinite_loss_skips_update_and_counts():
  _, _, state, train_step = _setup(batch_size=4, grad_accum=1)
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
  _, graphdef, state, _ = _setup()
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
  f = build_plan(run_config_from_dict(config)).schedule()   # a plain run: one piece
  assert float(f(0)) == 0.0 and abs(float(f(10)) - 1.0) < 1e-6
  end = {"cosine": 0.1, "wsd": 0.1, "constant": 1.0}[schedule]
  assert abs(float(f(100)) - end) < 1e-6
  if schedule == "wsd":
    assert float(f(79)) == 1.0 and float(f(90)) < 1.0


def test_muon_optimizer_runs():
  _, _, state, train_step = _setup(optimizer="muon")
  it = FakeIterator(4, 16)
  losses = []
  for _ in range(10):
    state, m = train_step(state, next(it))
    losses.append(float(m["loss"]))
  assert losses[-1] < losses[0]
