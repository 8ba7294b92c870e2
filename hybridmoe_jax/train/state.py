"""The train state: an explicit pytree of everything a step reads and writes.

The model graph (`graphdef`) is static and kept outside the state; the step merges it with
`params` (differentiated, optimised), `biases` (the routing biases: state, not parameters,
never in the optimizer tree; they hold the value to use at the NEXT step) and `rest` (any
other model variables, carried unchanged).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, ModelConfig
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.model import HybridLM


@flax.struct.dataclass
class TrainState:
  step: jax.Array        # int32 []: optimizer steps taken, skipped ones included
  params: nnx.State      # nnx.Param leaves, fp32 master weights
  opt_state: optax.OptState
  biases: nnx.State      # routing-bias variables (pending value for the next step)
  rest: nnx.State        # any other model variables
  rng: jax.Array         # uint32 [2]: training RNG, split every step
  skipped: jax.Array     # int32 []: steps skipped for a non-finite loss or gradient


def split_model(model: nnx.Module):
  """-> graphdef, params (nnx.Param), biases (RoutingBias), rest (everything else)."""
  return nnx.split(model, nnx.Param, RoutingBias, ...)


def create_train_state(cfg: ModelConfig, compute: ComputeConfig,
                       tx: optax.GradientTransformation, seed: int
                       ) -> tuple[nnx.GraphDef, TrainState]:
  """Build the model and its state (allocates; see `abstract_train_state` for shapes only).

  Args:
    cfg: the architecture; compute: runtime knobs (dtype, remat, kernel impls).
    tx: the optimizer (its state is built over `params` only).
    seed: model init seed (nnx.Rngs(seed)); the training RNG is PRNGKey(seed + 1).
  Where the model's ops run is the steps' execution plan (`ops.plan`), not the graphdef's.
  """
  model = HybridLM(cfg, rngs=nnx.Rngs(seed), compute=compute)
  graphdef, params, biases, rest = split_model(model)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                     biases=biases, rest=rest, rng=jax.random.PRNGKey(seed + 1),
                     skipped=jnp.zeros((), jnp.int32))
  return graphdef, state


def abstract_train_state(cfg: ModelConfig, compute: ComputeConfig,
                         tx: optax.GradientTransformation, seed: int
                         ) -> tuple[nnx.GraphDef, TrainState]:
  """`create_train_state`'s graphdef and state shapes (jax.ShapeDtypeStruct leaves);
  allocates nothing."""
  out = {}

  def build():
    graphdef, state = create_train_state(cfg, compute, tx, seed)
    out["graphdef"] = graphdef
    return state

  state = jax.eval_shape(build)
  return out["graphdef"], state
