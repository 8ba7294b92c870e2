"""The platform a program is compiled for: the ONE answer every implementation chooser reads.

A step traced under `jax.set_mesh(mesh)` targets the mesh's devices, which need not be the
host's: an ahead-of-time compile for a TPU topology (`jax.experimental.topologies`) runs on a
CPU-only machine, and must still pick the TPU kernels (Pallas KDA through Mosaic, splash
attention, the native ragged all-to-all). So the choosers (`ops.kda.choose`,
`ops.attention.api.resolve_impl` via `current_backend`, `parallel.exchange.resolve_impl`,
`model.impls`) ask `target_platform()` instead of `jax.default_backend()`.

`on_row_shards` runs a kernel (a Pallas Mosaic / Triton call, which XLA cannot partition)
on each device's rows when the step is traced under a mesh.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from hybridmoe_jax.config.sharding import batch_axes

GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # jax platform names of a GPU target


def _mesh_platform() -> str | None:
  """The platform of the active mesh's devices (abstract mesh inside a trace, else the mesh
  set by `jax.set_mesh`), or None without one."""
  abstract = jax.sharding.get_abstract_mesh()
  device = getattr(abstract, "abstract_device", None)
  if device is not None:
    return device.platform
  try:  # outside a trace only (inside one, the abstract mesh above is the answer)
    mesh = jax.sharding.get_mesh()
  except ValueError:
    return None
  devices = getattr(mesh, "devices", None)
  first = devices.flat[0] if getattr(devices, "size", 0) else None
  return getattr(first, "platform", None)


def target_platform() -> tuple[str, str]:
  """-> (platform, where it came from): "tpu" / "gpu" / "cpu" / ... of the devices the
  current program is compiled for.

  The active mesh's devices decide (`jax.set_mesh`, the abstract mesh inside jit / shard_map);
  without a mesh, the host's `jax.default_backend()`.
  """
  platform = _mesh_platform()
  if platform is not None:
    return platform, "the mesh's devices"
  return jax.default_backend(), "the host's default backend (no mesh set)"


def on_row_shards(fn, *args):
  """fn(*args) with every array argument and output split along dim 0 (rows of a batch):
  under a mesh with automatically partitioned axes, inside a shard_map over all of them
  (XLA cannot partition a Mosaic or Triton kernel call), rows split over the mesh's batch
  axes that divide them, replicated over the others. Without a mesh, or inside a manual
  shard_map already (a context runner's): fn(*args). None arguments pass through.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not mesh.auto_axes:
    return fn(*args)
  axes = batch_axes({a: mesh.shape[a] for a in mesh.auto_axes}, args[0].shape[0])
  spec = P(tuple(axes)) if axes else P()
  in_specs = tuple(None if x is None else spec for x in args)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec,
                       axis_names=set(mesh.auto_axes), check_vma=False)(*args)
