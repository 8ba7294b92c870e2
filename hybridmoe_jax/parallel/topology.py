"""TPU devices to compile for, without a TPU: libtpu's topology descriptions.

`topology_devices("v5p-256")` returns the 128 abstract TPU v5p devices of that slice
(`jax.experimental.topologies.get_topology_desc`): a mesh built from them (`parallel.mesh.
build_mesh(..., devices=...)`) lowers and compiles jitted steps with the TPU compiler on a
CPU-only host (deviceless ahead-of-time compilation, as MaxText's train_compile does); the
programs cannot run here. Names are `hardware.topology`'s (`hardware.parse_topology`).
libtpu comes with the `[tpu]` extra; without it the error says how to install it.
"""

from __future__ import annotations

import importlib.util
import os

import jax

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.hardware import TPU_GENERATIONS, parse_topology


class TopologyUnavailable(ConfigError):
  """libtpu (the TPU compiler) is not installed: the message says how to get it (a
  ConfigError: `hardware.topology` asks for what this install cannot do; CLIs print it as
  one line)."""


def install_hint() -> str:
  """The one command that brings the TPU compiler matching the installed jax."""
  return (f"pip install -e \".[tpu]\" (or pip install \"jax[tpu]=={jax.__version__}\"; "
          "the same version as the installed jax)")


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
  """The abstract TPU devices of topology / slice `name` ('v5p:2x2x1', 'v5p-256', ...).

  Raises:
    ConfigError: a name `parse_topology` or libtpu rejects (one line, naming the field).
    TopologyUnavailable: libtpu is not installed (the message gives the pip command).
  """
  chip, libtpu_name, chips = parse_topology(name)
  if importlib.util.find_spec("libtpu") is None:
    raise TopologyUnavailable(f"hardware.topology={name!r} needs the TPU compiler (libtpu), "
                              f"not installed: {install_hint()}")
  _quiet_libtpu(libtpu_name.split(":")[0])
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=libtpu_name)
  except Exception as e:  # JaxRuntimeError: libtpu's INVALID_ARGUMENT, one line of it
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConfigError(f"config field `hardware.topology` = {name!r} is invalid: libtpu "
                      f"rejects {libtpu_name!r} ({first})") from None
  devices = list(desc.devices)
  if len(devices) != chips:
    raise ConfigError(f"config field `hardware.topology` = {name!r}: libtpu describes "
                      f"{len(devices)} devices for {libtpu_name!r}, expected {chips} ({chip})")
  return devices
