"""The train state: an explicit pytree of everything a step reads and writes.

The model graph (`graphdef`) is static and kept outside the state; the step merges it with
`params` (differentiated, optimised), `biases` (the routing biases: state, not parameters,
never in the optimizer tree; they hold the value to use at the NEXT step) and `rest` (any
other model variables, carried unchanged).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.balancing import update_routing_biases


@flax.struct.dataclass
class TrainState:
  step: jax.Array        # int32 []: optimizer steps taken, skipped ones included
  params: nnx.State      # nnx.Param leaves, fp32 master weights
  opt_state: optax.OptState
  biases: nnx.State      # routing-bias variables (pending value for the next step)
  rest: nnx.State        # any other model variables
  rng: jax.Array         # uint32 [2]: training RNG, split every step
  skipped: jax.Array     # int32 []: steps skipped for a non-finite loss or gradient


@dataclasses.dataclass(frozen=True)
class ModelFns:
  """How the loop builds a model and balances its routers (swappable in tests).

  make_model(cfg, seed, remat) -> nnx.Module whose __call__(tokens, segment_ids=...) returns
  (logits [B, T, V] fp32, aux with aux["moe"][layer] = {"load": [E], ...} additive stats).
  update_biases(biases, moe_stats, cfg) -> (new_biases, {layer: {max_vio, bias_min, bias_max}}).
  """

  make_model: Callable[[ModelConfig, int, str], nnx.Module]
  update_biases: Callable[..., tuple[nnx.State, dict[str, Any]]]
  bias_type: type


def hybrid_lm_fns() -> ModelFns:
  """The real model: `HybridLM` with Quantile Balancing routing biases."""
  def make_model(cfg: ModelConfig, seed: int, remat: str) -> nnx.Module:
    return HybridLM(cfg, rngs=nnx.Rngs(seed), remat=remat)

  return ModelFns(make_model, update_routing_biases, RoutingBias)


def split_model(model: nnx.Module, bias_type: type):
  """-> graphdef, params, biases, rest."""
  return nnx.split(model, nnx.Param, bias_type, ...)


def create_train_state(fns: ModelFns, cfg: ModelConfig, tx: optax.GradientTransformation,
                       seed: int, remat: str) -> tuple[nnx.GraphDef, TrainState]:
  """Build the model and its state (allocates; wrap in `abstract_train_state` to avoid)."""
  model = fns.make_model(cfg, seed, remat)
  graphdef, params, biases, rest = split_model(model, fns.bias_type)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                     biases=biases, rest=rest, rng=jax.random.PRNGKey(seed + 1),
                     skipped=jnp.zeros((), jnp.int32))
  return graphdef, state


def abstract_train_state(fns: ModelFns, cfg: ModelConfig, tx: optax.GradientTransformation,
                         seed: int, remat: str) -> tuple[nnx.GraphDef, TrainState]:
  """Shapes and dtypes of the train state (jax.ShapeDtypeStruct leaves); allocates nothing."""
  out = {}

  def build():
    graphdef, state = create_train_state(fns, cfg, tx, seed, remat)
    out["graphdef"] = graphdef
    return state

  state = jax.eval_shape(build)
  return out["graphdef"], state


def num_leaves(tree) -> int:
  return len(jax.tree.leaves(tree))
