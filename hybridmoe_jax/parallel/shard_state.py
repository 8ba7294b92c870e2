"""Placing the train state on a mesh: init directly sharded, shardings for restore.

Every leaf (parameters, optimizer state, routing biases, step, rng) gets its NamedSharding
from `parallel.rules.tree_shardings`; scalars and unmatched leaves are replicated.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.parallel.rules import tree_shardings
from hybridmoe_jax.train.state import ModelFns, TrainState, abstract_train_state, create_train_state


def state_shardings(abstract_state: TrainState, mesh: Mesh):
  """A TrainState-shaped tree of NamedSharding."""
  return tree_shardings(abstract_state, mesh)


def with_shardings(abstract_state: TrainState, shardings):
  """ShapeDtypeStruct leaves carrying their target sharding (orbax restores onto them)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_state, shardings)


def create_sharded_train_state(fns: ModelFns, cfg: ModelConfig, tx: optax.GradientTransformation,
                               seed: int, remat: str, mesh: Mesh):
  """-> (graphdef, state, shardings): the state initialised straight into its shards.

  The init runs under jit with `out_shardings`, so no device ever holds the whole model;
  values equal the unsharded `create_train_state` (same seeds, partitionable RNG).
  """
  graphdef, abstract = abstract_train_state(fns, cfg, tx, seed, remat)
  shardings = state_shardings(abstract, mesh)
  init = jax.jit(lambda: create_train_state(fns, cfg, tx, seed, remat)[1],
                 out_shardings=shardings)
  with jax.set_mesh(mesh):
    state = init()
  return graphdef, state, shardings
