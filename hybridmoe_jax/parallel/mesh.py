"""The device mesh (axes data, fsdp, expert, tensor) and how batches are laid out on it.

The sizes are a plain {axis: size} mapping (the `mesh` config section); `mesh_shape`
resolves its -1 against the device count.
Every axis is `AxisType.Auto`: the code states shardings through the rules of
`parallel.rules` and leaves the rest to XLA's partitioner; only the MoE dispatch is manual
(`jax.shard_map` over `expert`, see `parallel.ep_moe`).
Batch layout: sequences [B, ...] are split over (data, fsdp, expert), each axis where the
rows divide (`config.sharding.batch_axes`); every batch must split over (data, fsdp).
Token-level MoE work [B T, ...] is split over (data, fsdp, expert) (`TOKEN_AXES`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.run import MeshConfig
from hybridmoe_jax.config.sharding import DATA_AXES, MESH_AXES, batch_axes


def _bad(field: str, value: Any, allowed: str) -> ConfigError:
  return ConfigError(f"config field `{field}` = {value!r} is invalid: allowed {allowed}")


def mesh_shape(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """{axis: size} for every axis of MESH_AXES, the one -1 resolved to the remaining devices.

  Args:
    sizes: axis -> int >= 1, or -1 (at most one axis) for the remaining devices; axes of
      MESH_AXES only; a missing axis has size 1.
    num_devices: the devices the mesh must use, all of them.

  Raises:
    ConfigError: naming `mesh` / `mesh.<axis>` for an unknown axis, a bad size, two -1s, or
      sizes whose product is not `num_devices`.
  """
  unknown = sorted(set(sizes) - set(MESH_AXES))
  if unknown:
    raise _bad("mesh", unknown, f"axes among {MESH_AXES}")
  out = {a: sizes.get(a, 1) for a in MESH_AXES}
  MeshConfig(**out)  # the sizes' ranges, at most one -1: the `mesh` section's
  free = [a for a, v in out.items() if v == -1]
  fixed = math.prod(v for v in out.values() if v > 0)
  if free:
    if num_devices % fixed:
      raise _bad(f"mesh.{free[0]}", -1,
                 f"-1 only when the other axes ({fixed}) divide the {num_devices} devices")
    out[free[0]] = num_devices // fixed
  if math.prod(out.values()) != num_devices:
    raise _bad("mesh", out, f"axis sizes whose product is the {num_devices} device(s)")
  return out


def available_devices() -> list:
  """All devices of all processes (the mesh must use every one of them)."""
  return list(jax.devices())


def build_mesh(mesh_sizes: Mapping[str, int], devices: Sequence | None = None) -> Mesh:
  """Mesh with axes (data, fsdp, expert, tensor), Auto axis types.

  Args:
    mesh_sizes: {axis: size} (the `mesh` config section; at most one -1, see `mesh_shape`).
    devices: defaults to `available_devices()`; their number must equal the mesh size.

  Raises:
    ConfigError: naming `mesh` when the sizes do not multiply to the device count.
  """
  devices = available_devices() if devices is None else list(devices)
  sizes = mesh_shape(mesh_sizes, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  types = (AxisType.Auto,) * len(MESH_AXES)
  if len(devices) == len(jax.devices()) or devices[0].platform != jax.default_backend():
    # make_mesh orders devices for the physical topology (ICI rings on TPU, NVLink on GPU);
    # a whole TPU topology described for an ahead-of-time compile (`parallel.topology`)
    # gets the same layout a run on that slice would.
    try:
      return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except NotImplementedError as e:   # an axis size no product of physical axes gives
      raise ConfigError(f"config field `mesh` = {sizes} does not map onto the devices' "
                        f"physical axes (each mesh axis must be a product of some of them): "
                        f"{str(e).split('.')[0]}") from None
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=types)


def axis_size(mesh: Mesh, axes: Sequence[str]) -> int:
  return int(np.prod([mesh.shape[a] for a in axes]))


def batch_sharding(mesh: Mesh, *, sequence: bool = False,
                   rows: int | None = None) -> NamedSharding:
  """[B, ...] arrays of B = `rows` sequences: batch dimension over the batch axes that divide
  it (`batch_axes`; all of data, fsdp, expert when rows is None), the rest replicated; with
  `sequence`, [B, T, ...] arrays also split T over `context`."""
  axes = batch_axes(dict(mesh.shape), rows)
  return NamedSharding(mesh, P(axes, "context") if sequence else P(axes))


def check_mesh_fits(mesh: Mesh, *, num_experts: int, batch_size: int, grad_accum: int,
                    seq_len: int, context_zigzag: bool = False) -> None:
  """One clear ConfigError per mismatch between the model/batch and the mesh (before compile).

  - experts must divide evenly over `expert` (each shard owns E / expert whole experts);
  - each microbatch (batch_size / grad_accum sequences) must split over data x fsdp (and
    splits over expert too where it divides: `batch_axes`);
  - each sequence must split over `context` (in 2 x context pieces with context_zigzag);
  - its tokens must split over data x fsdp x expert (the MoE dispatch's token shards).
  """
  ep = mesh.shape["expert"]
  if num_experts % ep:
    raise ConfigError(f"config field `model.moe.num_experts` = {num_experts} is invalid: "
                      f"allowed a multiple of mesh.expert={ep} (each expert shard owns "
                      "whole experts)")
  dp = axis_size(mesh, DATA_AXES)
  micro = batch_size // grad_accum
  if micro % dp:
    raise ConfigError(
        f"config field `train.batch_size` = {batch_size} is invalid: allowed a multiple of "
        f"grad_accum x mesh.data x mesh.fsdp = {grad_accum} x {mesh.shape['data']} x "
        f"{mesh.shape['fsdp']} = {grad_accum * dp} (every data shard needs whole sequences "
        "in each microbatch)")
  cp = mesh.shape["context"]
  if context_zigzag and cp == 1:
    raise ConfigError("config field `mesh.context_zigzag` = True is invalid: allowed False "
                      "unless mesh.context > 1 (the context axis resolved to 1)")
  pieces = 2 * cp if context_zigzag else cp
  if seq_len % pieces:
    raise ConfigError(f"config field `train.seq_len` = {seq_len} is invalid: allowed a "
                      f"multiple of {'2 x ' if context_zigzag else ''}mesh.context={cp} "
                      f"(each context shard holds seq_len / {cp} tokens of every sequence"
                      f"{', in 2 zigzag pieces' if context_zigzag else ''})")
  tokens = micro * seq_len
  if tokens % (dp * ep):
    raise ConfigError(
        f"config field `train.seq_len` = {seq_len} is invalid: the {tokens} tokens of a "
        f"microbatch must split over data x fsdp x expert = {dp * ep} shards")


def host_batch_to_global(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
  """Place this process's rows of the global batch on the mesh (multi-host safe).

  Each process holds batch_size / process_count sequences (its grain shard); the global
  array is their concatenation in process order, split over (data, fsdp).
  """
  rows, length = np.shape(batch["tokens"])[:2]
  dp = axis_size(mesh, DATA_AXES)
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
    per_token = per_row and value.ndim > 1 and value.shape[1] == length  # tokens, segments
    sharding = (batch_sharding(mesh, sequence=per_token, rows=rows * jax.process_count())
                if per_row
                else NamedSharding(mesh, P()))
    if jax.process_count() == 1:
      out[key] = jax.device_put(value, sharding)
    else:
      out[key] = jax.make_array_from_process_local_data(sharding, value)
  return out
