"""Placing a train state on a mesh: init directly sharded, shardings for restore.

Every leaf (parameters, optimizer state, routing biases, step, rng) gets its NamedSharding
from `parallel.rules.tree_shardings`; scalars and unmatched leaves are replicated. The state
is any pytree (the train loop's TrainState): this module only sees its builder and shapes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh

from hybridmoe_jax.parallel.rules import tree_shardings


def with_shardings(abstract_state: Any, shardings):
  """ShapeDtypeStruct leaves carrying their target sharding (orbax restores onto them)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_state, shardings)


def init_sharded(build: Callable[[], Any], abstract_state: Any, mesh: Mesh):
  """-> (state, shardings): `build()` initialised straight into its shards.

  Args:
    build: zero-argument function returning the state (allocating, e.g. a model init).
    abstract_state: its shapes and dtypes (`jax.eval_shape(build)`), fixing the layout.
    mesh: the mesh.

  The init runs under jit with `out_shardings`, so no device ever holds the whole model;
  values equal an unsharded `build()` (same seeds, partitionable RNG).
  """
  shardings = tree_shardings(abstract_state, mesh)
  with jax.set_mesh(mesh):
    state = jax.jit(build, out_shardings=shardings)()
  return state, shardings
