"""TPU or GPU devices to compile for, without the accelerator: deviceless topologies.

`topology_devices("v5p-256")` returns the 128 abstract TPU v5p devices of that slice
(`jax.experimental.topologies.get_topology_desc`): a mesh built from them (`parallel.mesh.
build_mesh(..., devices=...)`) lowers and compiles jitted steps with the TPU compiler on a
CPU-only host (deviceless ahead-of-time compilation, as MaxText's train_compile does); the
programs cannot run here. Names are `hardware.topology`'s (`hardware.parse_topology`).
libtpu comes with the `[tpu]` extra; without it the error says how to install it.

GPU nodes ('h100:8', 'h200:2x8') come from the CUDA plugin (the `[gpu]` extra) in the same
way: `get_topology_desc(platform="cuda", target_config=<XLA GpuTargetConfigProto text>,
topology="1xHxN")`, the target config read from configs/gpu_targets/ (`gpu_target_config`).
The devices' platform is "gpu", so the choosers pick the GPU paths (Pallas Triton KDA,
Triton attention, the native ragged all-to-all). The CUDA plugin must not look for a GPU:
jax's platforms must be "cpu" before the first backend starts (the dry run sets it).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import jax

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.hardware import (GPU_TARGETS, TPU_GENERATIONS, is_gpu_topology,
                                           parse_topology)

# configs/gpu_targets/ of the repository (an editable install: the package sits beside it).
GPU_TARGETS_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs" / "gpu_targets"


class TopologyUnavailable(ConfigError):
  """libtpu (the TPU compiler) is not installed: the message says how to get it (a
  ConfigError: `hardware.topology` asks for what this install cannot do; CLIs print it as
  one line)."""


def has_cuda_plugin() -> bool:
  """Whether jax's CUDA plugin (the XLA:GPU compiler) is installed."""
  return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def _quiet_libtpu(chip_gen: str) -> None:
  """Environment for libtpu on a machine that is not a TPU host, set before it loads (a
  user's own values win): no lockfile against other processes that loaded it (tests, a
  second compile), no metadata-server queries, a local worker and an accelerator type, so
  it neither blocks nor prints a page of warnings to stderr."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  cores = TPU_GENERATIONS[chip_gen][1]
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip_gen}-{4 * cores}")


def topology_devices(name: str) -> list:
  """The abstract TPU devices of topology / slice `name` ('v5p:2x2x1', 'v5p-256', ...), or
  the GPUs of a GPU node name ('h100:8': `gpu_topology_devices`).

  Raises:
    ConfigError: a name `parse_topology` or libtpu rejects (one line, naming the field).
    TopologyUnavailable: libtpu is not installed (the message gives the pip command).
  """
  if is_gpu_topology(name):
    return gpu_topology_devices(name)
  chip, libtpu_name, chips = parse_topology(name)
  if importlib.util.find_spec("libtpu") is None:
    raise TopologyUnavailable(f"hardware.topology={name!r} needs the TPU compiler (libtpu), "
                              f"not installed: pip install -e \".[tpu]\" (or pip install "
                              f"\"jax[tpu]=={jax.__version__}\"; the same version as the "
                              "installed jax)")
  _quiet_libtpu(libtpu_name.split(":")[0])
  return _described(name, "libtpu", libtpu_name, chips, chip, platform="tpu",
                    topology_name=libtpu_name)


def _described(name: str, compiler: str, compiler_name: str, chips: int, chip: str,
               **desc_kwargs) -> list:
  """The devices of get_topology_desc(**desc_kwargs); the compiler's rejection, or a device
  count other than `chips`, as a one-line ConfigError naming `hardware.topology`."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    desc = topologies.get_topology_desc(**desc_kwargs)
  except Exception as e:  # JaxRuntimeError: the compiler's INVALID_ARGUMENT, one line of it
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(f"config field `hardware.topology` = {name!r} is invalid: {compiler} "
                      f"rejects {compiler_name!r} ({first})") from None
  devices = list(desc.devices)
  if len(devices) != chips:
    raise ConfigError(f"config field `hardware.topology` = {name!r}: {compiler} describes "
                      f"{len(devices)} devices for {compiler_name!r}, expected {chips} ({chip})")
  return devices


def _platforms() -> str:
  """jax's platforms setting ("cpu", "" when unset): what its backends start with."""
  return jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")


def gpu_target_config(chip: str) -> str:
  """The text of configs/gpu_targets/<GPU_TARGETS[chip]>.txtpb (XLA's GpuTargetConfigProto).

  Raises ConfigError when the file is missing or unreadable (a broken checkout)."""
  path = GPU_TARGETS_DIR / f"{GPU_TARGETS[chip]}.txtpb"
  try:
    return path.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"hardware.topology: the {chip} target config {path} cannot be read "
                      f"({type(e).__name__})") from None


def gpu_topology_devices(name: str) -> list:
  """The abstract GPU devices of `name` ('h100:8', 'h200:2x8'): platform "gpu", device_kind
  the target config's name (e.g. "NVIDIA H100 80GB HBM3"), process_index = host.

  Raises:
    ConfigError: a bad name or a target config the plugin rejects (one line).
    TopologyUnavailable: the CUDA plugin is not installed, or jax already started a backend
      other than CPU (the plugin would look for a GPU).
  """
  chip, jax_topology, chips = parse_topology(name)
  if not has_cuda_plugin():
    raise TopologyUnavailable(f"hardware.topology={name!r} needs the GPU compiler (jax's CUDA "
                              f"plugin), not installed: pip install -e \".[gpu]\" (or pip "
                              f"install \"jax[cuda12]=={jax.__version__}\"; the same version "
                              "as the installed jax)")
  platforms = _platforms()
  if platforms != "cpu":
    raise TopologyUnavailable(f"hardware.topology={name!r}: compiling for GPUs without one needs "
                              "JAX_PLATFORMS=cpu set before jax starts (got "
                              f"{platforms or 'unset'!r})")
  return _described(name, "the CUDA plugin", jax_topology, chips, chip, platform="cuda",
                    target_config=gpu_target_config(chip), topology=jax_topology)
