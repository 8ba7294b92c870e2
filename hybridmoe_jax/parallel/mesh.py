"""The device mesh (axes data, fsdp, expert, tensor) and how batches are laid out on it.

The sizes come from the `mesh` config section (`train.config.mesh_shape` resolves -1).
Every axis is `AxisType.Auto`: the code states shardings through the rules of
`parallel.rules` and leaves the rest to XLA's partitioner; only the MoE dispatch is manual
(`jax.shard_map` over `expert`, see `parallel.ep_moe`).
Batch layout: sequences [B, ...] are split over (data, fsdp); token-level MoE work
[B T, ...] additionally over expert (the token axes of `TOKEN_AXES`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.sharding import BATCH_AXES, MESH_AXES, TOKEN_AXES  # noqa: F401  (re-exported)



def available_devices() -> list:
  """All devices of all processes (the mesh must use every one of them)."""
  return list(jax.devices())


def build_mesh(mesh_cfg: ml_collections.ConfigDict, devices: Sequence | None = None) -> Mesh:
  """Mesh with axes (data, fsdp, expert, tensor), Auto axis types.

  Args:
    mesh_cfg: the `mesh` config section (sizes, at most one -1 = the remaining devices).
    devices: defaults to `available_devices()`; their number must equal the mesh size.

  Raises:
    ConfigError: naming `mesh` when the sizes do not multiply to the device count.
  """
  from hybridmoe_jax.train.config import mesh_shape  # pylint: disable=g-import-not-at-top
  devices = available_devices() if devices is None else list(devices)
  sizes = mesh_shape(mesh_cfg, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  types = (AxisType.Auto,) * len(MESH_AXES)
  if len(devices) == len(jax.devices()):
    # make_mesh orders devices for the physical topology (ICI rings on TPU, NVLink on GPU).
    return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=types)


def axis_size(mesh: Mesh, axes: Sequence[str]) -> int:
  return int(np.prod([mesh.shape[a] for a in axes]))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[B, ...] arrays: batch dimension over (data, fsdp), the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def check_mesh_fits(mesh: Mesh, *, num_experts: int, batch_size: int, grad_accum: int,
                    seq_len: int) -> None:
  """One clear ConfigError per mismatch between the model/batch and the mesh (before compile).

  - experts must divide evenly over `expert` (each shard owns E / expert whole experts);
  - each microbatch (batch_size / grad_accum sequences) must split over data x fsdp;
  - its tokens must split over data x fsdp x expert (the MoE dispatch's token shards).
  """
  ep = mesh.shape["expert"]
  if num_experts % ep:
    raise ConfigError(f"config field `model.moe.num_experts` = {num_experts} is invalid: "
                      f"allowed a multiple of mesh.expert={ep} (each expert shard owns "
                      "whole experts)")
  dp = axis_size(mesh, BATCH_AXES)
  micro = batch_size // grad_accum
  if micro % dp:
    raise ConfigError(
        f"config field `train.batch_size` = {batch_size} is invalid: allowed a multiple of "
        f"grad_accum x mesh.data x mesh.fsdp = {grad_accum} x {mesh.shape['data']} x "
        f"{mesh.shape['fsdp']} = {grad_accum * dp} (every data shard needs whole sequences "
        "in each microbatch)")
  tokens = micro * seq_len
  if tokens % (dp * ep):
    raise ConfigError(
        f"config field `train.seq_len` = {seq_len} is invalid: the {tokens} tokens of a "
        f"microbatch must split over data x fsdp x expert = {dp * ep} shards")


def describe(mesh: Mesh) -> str:
  return " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)


def host_batch_to_global(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
  """Place this process's rows of the global batch on the mesh (multi-host safe).

  Each process holds batch_size / process_count sequences (its grain shard); the global
  array is their concatenation in process order, split over (data, fsdp).
  """
  rows = np.shape(batch["tokens"])[0]
  dp = axis_size(mesh, BATCH_AXES)
  if (rows * jax.process_count()) % dp:  # e.g. a curriculum stage with a smaller batch
    raise ConfigError(f"a batch of {rows * jax.process_count()} sequences does not split over "
                      f"mesh.data x mesh.fsdp = {dp}: choose batch sizes that are multiples "
                      f"of {dp}")
  out = {}
  for key, value in batch.items():
    value = np.asarray(value)
    # Per-sequence arrays split with the batch; anything else (e.g. a shared image table)
    # is replicated.
    per_row = value.ndim > 0 and value.shape[0] == rows
    sharding = batch_sharding(mesh) if per_row else NamedSharding(mesh, P())
    if jax.process_count() == 1:
      out[key] = jax.device_put(value, sharding)
    else:
      out[key] = jax.make_array_from_process_local_data(sharding, value)
  return out
