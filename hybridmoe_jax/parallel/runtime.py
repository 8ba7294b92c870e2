"""The parallel layout of one training run, as the train loop uses it.

`setup(config, cfg)` builds the mesh from the `mesh` section, checks the model and batch
against it (one ConfigError each, before any data or compute) and answers the loop's few
questions: how many rows this process loads, how to initialise or restore the state onto
the mesh, what to pass to `make_train_step` / `make_eval_step`.
A single-process single-device run gets `mesh=None`: the plain, unsharded code path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
import optax
from jax.sharding import Mesh

from hybridmoe_jax.config import ConfigError, ModelConfig
from hybridmoe_jax.parallel import mesh as mesh_lib
from hybridmoe_jax.parallel import shard_state


@dataclasses.dataclass
class Runtime:
  """mesh (None: one device, unsharded); state_shardings set once the state exists."""

  mesh: Mesh | None
  process_index: int = 0
  process_count: int = 1
  state_shardings: Any = None

  def host_batch_size(self, batch_size: int) -> int:
    """Rows of each global batch that this process loads (its grain shard)."""
    return batch_size // self.process_count

  def restore_target(self, abstract_state):
    """The abstract state orbax restores into: with shardings on a mesh (any mesh shape)."""
    if self.mesh is None:
      return abstract_state
    self.state_shardings = shard_state.state_shardings(abstract_state, self.mesh)
    return shard_state.with_shardings(abstract_state, self.state_shardings)

  def init_state(self, fns, cfg: ModelConfig, tx: optax.GradientTransformation, seed: int,
                 remat: str, create):
    """(graphdef, state): `create(...)` unsharded, or initialised straight into shards."""
    if self.mesh is None:
      return create(fns, cfg, tx, seed, remat)
    graphdef, state, self.state_shardings = shard_state.create_sharded_train_state(
        fns, cfg, tx, seed, remat, self.mesh)
    return graphdef, state

  def step_kwargs(self, train: bool = True) -> dict[str, Any]:
    if self.mesh is None:
      return {}
    if train:
      return {"mesh": self.mesh, "state_shardings": self.state_shardings}
    return {"mesh": self.mesh}


def setup(config: ml_collections.ConfigDict, cfg: ModelConfig, devices=None) -> Runtime:
  """Mesh + checks for `config` (root config) and `cfg` (its model). Raises ConfigError."""
  t = config.train
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  count = jax.process_count()
  if t.batch_size % count:
    raise ConfigError(f"config field `train.batch_size` = {t.batch_size} is invalid: allowed "
                      f"a multiple of the {count} processes (each loads batch_size / "
                      f"{count} rows)")
  if count > 1 and getattr(getattr(cfg, "vision", None), "enabled", False):
    raise NotImplementedError("multi-process runs of vision models: the image-text pipeline "
                              "has no per-host sharding yet (text-only models shard by host)")
  mesh_lib.check_mesh_fits(mesh, num_experts=cfg.moe.num_experts, batch_size=t.batch_size,
                           grad_accum=t.grad_accum, seq_len=t.seq_len)
  if mesh.size == 1 and count == 1:
    return Runtime(mesh=None)
  return Runtime(mesh=mesh, process_index=jax.process_index(), process_count=count)
