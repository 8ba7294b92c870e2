"""The parallel layout of one training run, as the train loop uses it.

`setup(mesh_sizes, cfg, compute, batch_size=..., grad_accum=..., seq_len=...)` builds the mesh,
checks the model and batch against it (one ConfigError each, before any data or compute)
and answers the loop's few questions: where the ops run (`plan`, the execution plan the
steps are traced under), how to initialise or restore the state onto the mesh, what to pass
to `make_train_step` / `make_eval_step`. A single-process single-device run gets
`mesh=None` and the LOCAL plan: the plain, unsharded code path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
from jax.sharding import Mesh

from hybridmoe_jax.config import ComputeConfig, ConfigError, ModelConfig
from hybridmoe_jax.ops.plan import LOCAL, ExecutionPlan
from hybridmoe_jax.parallel import mesh as mesh_lib
from hybridmoe_jax.parallel.rules import tree_shardings
from hybridmoe_jax.parallel.context import ContextParallel
from hybridmoe_jax.parallel.ep_moe import ExpertParallelDispatch


@dataclasses.dataclass
class Runtime:
  """mesh (None: one device, unsharded); plan: where the model's ops run on it (`ops.plan`:
  the expert-parallel dispatch, the context runner when mesh.context > 1); state_shardings,
  set once the state exists: every leaf's NamedSharding (parameters, optimizer state,
  routing biases, step, rng) from `parallel.rules.tree_shardings`, scalars and unmatched
  leaves replicated. The state is any pytree (the train loop's TrainState): only its builder
  and shapes are seen here."""

  mesh: Mesh | None
  plan: ExecutionPlan = LOCAL
  process_index: int = 0
  process_count: int = 1
  state_shardings: Any = None

  def restore_target(self, abstract_state):
    """The abstract state orbax restores into: with shardings on a mesh (any mesh shape)."""
    if self.mesh is None:
      return abstract_state
    self.state_shardings = tree_shardings(abstract_state, self.mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_state, self.state_shardings)

  def init_state(self, build: Callable[[], Any], abstract_state):
    """A fresh state: `build()` (zero-arg, allocating, e.g. a model init) unsharded, or
    traced once and initialised straight into the shards of `abstract_state`'s layout
    (its shapes and dtypes, `jax.eval_shape(build)`).

    Sharded, the init runs under jit with `out_shardings`, so no device ever holds the
    whole model; values equal an unsharded `build()` (same seeds, partitionable RNG).
    Unsharded, the state is committed to the first device, as a restored one is (orbax
    commits what it reads): jit keys its programs on that, so a resumed run finds the
    programs of a fresh one in the persistent compilation cache instead of compiling all
    of them again."""
    if self.mesh is None:
      return jax.device_put(build(), jax.devices()[0])
    shardings = tree_shardings(abstract_state, self.mesh)
    with jax.set_mesh(self.mesh):
      state = jax.jit(build, out_shardings=shardings)()
    self.state_shardings = shardings
    return state

  def step_kwargs(self, train: bool = True) -> dict[str, Any]:
    if self.mesh is None:
      return {}
    if train:
      return {"mesh": self.mesh, "state_shardings": self.state_shardings, "plan": self.plan}
    return {"mesh": self.mesh, "plan": self.plan}


def setup(mesh_sizes: Mapping[str, int], cfg: ModelConfig, compute: ComputeConfig, *,
          batch_size: int, grad_accum: int, seq_len: int, devices=None) -> Runtime:
  """Mesh, checks and MoE dispatch of a run. Raises ConfigError naming the field.

  Args:
    mesh_sizes: {axis: size} (the `mesh` config section; one -1 = the remaining devices),
      optionally with `context_zigzag` (bool, default False): the zigzag sequence layout of
      the context-parallel mixers (`parallel.context`).
    cfg: the model (its expert count must split over the `expert` axis).
    compute: runtime knobs; moe_impl "ragged" on a multi-device mesh gets the
      expert-parallel dispatch with `moe_capacity_factor`, "dense" stays local.
    batch_size, grad_accum, seq_len: the global batch (train.* fields), checked against
      the mesh and the process count.
    devices: the mesh's devices (default: all of them).
  """
  zigzag = bool(mesh_sizes.get("context_zigzag", False))
  mesh = mesh_lib.build_mesh({a: v for a, v in mesh_sizes.items() if a != "context_zigzag"},
                             devices)
  count = jax.process_count()
  if batch_size % count:
    raise ConfigError(f"config field `train.batch_size` = {batch_size} is invalid: allowed "
                      f"a multiple of the {count} processes (each loads batch_size / "
                      f"{count} rows)")
  if count > 1 and cfg.vision.enabled:
    raise NotImplementedError("multi-process runs of vision models: the image-text pipeline "
                              "has no per-host sharding yet (text-only models shard by host)")
  mesh_lib.check_mesh_fits(mesh, num_experts=cfg.moe.num_experts, batch_size=batch_size,
                           grad_accum=grad_accum, seq_len=seq_len, context_zigzag=zigzag)
  cp = mesh.shape["context"]
  piece = seq_len // (2 * cp if zigzag else cp)
  if cp > 1 and "kda" in cfg.layer_kinds and piece < cfg.kda.conv_size - 1:
    raise ConfigError(f"config field `train.seq_len` = {seq_len} is invalid: allowed pieces "
                      f"of >= model.kda.conv_size - 1 = {cfg.kda.conv_size - 1} tokens per "
                      f"context shard{' (2 zigzag pieces each)' if zigzag else ''}: the short "
                      "convolutions' halo comes from the previous piece only")
  # layers/mla.py refuses positions under a context runner, at trace time: say it here,
  # before the state is initialised.
  for field in ("rope_theta", "logn_base"):
    value = getattr(cfg.mla, field)
    if cp > 1 and "mla" in cfg.layer_kinds and value:
      raise ConfigError(f"config field `model.mla.{field}` = {value!r} is invalid: allowed 0 "
                        f"with mesh.context={cp} > 1 (the context-parallel MLA does not see "
                        "the shards' positions: RoPE and logn scaling are not implemented "
                        "under context parallelism)")
  if mesh.size == 1 and count == 1:
    return Runtime(mesh=None)
  dispatch = (ExpertParallelDispatch(mesh, capacity_factor=compute.moe_capacity_factor)
              if compute.moe_impl == "ragged" else None)
  context = (ContextParallel(mesh, block=compute.mla_block, zigzag=zigzag)
             if mesh.shape["context"] > 1 else None)
  return Runtime(mesh=mesh, plan=ExecutionPlan(context=context, moe_dispatch=dispatch),
                 process_index=jax.process_index(), process_count=count)
