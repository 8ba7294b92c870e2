"""The real HybridLM in the train step and loop (shrunk tiny config, a few steps)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, model_config_from_dict
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.train import optim, step as step_lib
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.train.state import abstract_train_state, create_train_state, split_model
from tests.conftest import load_config


def _small(**train):
  config = load_config("tiny")
  # One KDA layer (dense FFN) and one MLA layer (MoE) of the tiny model, 16-token KDA chunks:
  # every kind of layer at a fraction of the 4-layer compile (the claims are per layer kind).
  config.model.update(dict(num_layers=2, layer_kinds=("kda", "mla")))
  config.compute.kda_chunk_size = 16
  config.train.update({**dict(steps=2, batch_size=2, seq_len=32, warmup=1, log_every=1,
                              eval_every=0, eval_batches=1, checkpoint_every=0,
                              heatmap_every=0), **train})
  return config


def test_bias_outside_gradient_and_optimizer():
  config = _small()
  cfg = model_config_from_dict(config.model)
  tx = optim.make_optimizer(run_config_from_dict(config).train, optax.constant_schedule(1e-3))
  graphdef, state = create_train_state(cfg, ComputeConfig(), tx, seed=0)
  biases = nnx.to_flat_state(state.biases)
  assert [p for p, _ in biases] == [("layers", i, "ffn", "bias") for i in cfg.moe_layers]
  assert all(isinstance(v, RoutingBias) for _, v in biases)
  assert not any(isinstance(v, RoutingBias) for _, v in nnx.to_flat_state(state.params))
  # Optimizer moments mirror the parameters exactly: no bias-shaped leaf sneaks in.
  adam = state.opt_state[1][0]
  assert jax.tree.structure(adam.mu) == jax.tree.structure(state.params)
  assert not jax.tree.leaves(state.rest)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32)), jnp.int32)
  seg = jnp.ones_like(tokens)
  # One jitted program for the gradient and the forward's stats (op by op, every primitive
  # of the model compiles on its own).
  nll = lambda b: step_lib._forward_nll(graphdef, state.params, b, state.rest, tokens, seg)
  (_, (_, stats)), grad = jax.jit(jax.value_and_grad(nll, has_aux=True))(state.biases)
  assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grad))
  # The forward's routing stats are shaped like the bias state (one stats dict per leaf).
  assert jax.tree.structure(nnx.to_pure_dict(state.biases)) == jax.tree.structure(
      stats, is_leaf=lambda x: isinstance(x, dict) and "load" in x)
  # The abstract state has the same graph and structure, and allocates nothing.
  abs_graphdef, abstract = abstract_train_state(cfg, ComputeConfig(), tx, seed=0)
  assert abs_graphdef == graphdef
  assert jax.tree.structure(abstract) == jax.tree.structure(state)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
  model = nnx.merge(graphdef, state.params, state.biases, state.rest)
  assert jax.tree.structure(split_model(model)[2]) == jax.tree.structure(state.biases)


@pytest.mark.parametrize("variant", [
    dict(),
    # bf16 compute + full remat + 2 microbatches: ~50 s of compilation on 2 busy cores.
    pytest.param(dict(dtype="bfloat16", remat="full", grad_accum=2), marks=pytest.mark.slow),
])
def test_loop_runs_real_model(tmp_path, variant):
  config = _small(**{k: v for k, v in variant.items() if k != "dtype"})
  if "dtype" in variant:
    config.compute.dtype = variant["dtype"]
  s = train_and_evaluate(run_config_from_dict(config), str(tmp_path))
  assert s["end_step"] == 2 and s["skipped_steps"] == 0
  assert np.isfinite(s["last_loss"]) and s["eval"]["bits_per_byte"] > 0
  biases = [np.asarray(b) for b in jax.tree.leaves(s["state"].biases)]
  assert all(b.shape == (8,) and np.abs(b).max() > 0 for b in biases)   # QB moved them
  for p in jax.tree.leaves(s["state"].params):
    assert p.dtype == jnp.float32                                       # fp32 master weights
