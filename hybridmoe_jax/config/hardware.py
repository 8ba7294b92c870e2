"""`hardware`: the accelerator a plan targets, and the one table of chips (memory, peak
FLOP/s, HBM bandwidth) that the dry run's fit check and the AOT report's MFU read; TPU
topology and GPU node names (`parse_topology`) for the deviceless AOT compile. Part of the run config
(`run_config.RunConfig.hardware`); jax-free, like the rest of rank 0.
"""

from __future__ import annotations

import dataclasses
import math
import re

from hybridmoe_jax.config import Allowed, Checked, ConfigError, ranged, require


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip as a plan sees it: memory and dense peak bf16 FLOP/s."""

  memory_gib: float       # HBM per device, GiB = 2**30 bytes
  peak_bf16_flops: float  # dense (no sparsity) bf16 matmul peak per device, FLOP/s
  hbm_bytes_per_s: float  # HBM bandwidth per device, bytes/s


# The accelerators a plan may name in `hardware.device` (and a TPU `hardware.topology`
# implies): the ONE table of chip memory and peak FLOP/s (the dry run's fit check, the AOT
# report's MFU). Sources, as published by the vendors (2024-2025):
#   NVIDIA datasheets (decimal GB; dense bf16 Tensor Core, i.e. half the "with sparsity"
#   figure): H100 SXM 80 GB 989 TFLOP/s 3.35 TB/s, H200 SXM 141 GB 989 TFLOP/s 4.8 TB/s,
#   B200 180 GB 2.25 PFLOP/s 8 TB/s.
#   Google Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e),
#   per chip (one JAX device; v4 and v5p are megacore chips of 2 TensorCores):
#   v4 32 GiB 275 TFLOP/s 1,228 GB/s, v5e 16 GiB 197 TFLOP/s 819 GB/s,
#   v5p 95 GiB 459 TFLOP/s 2,765 GB/s, v6e (Trillium) 32 GiB 918 TFLOP/s 1,640 GB/s.
CHIPS = {
    "h100": Chip(80e9 / 2 ** 30, 989e12, 3.35e12), "h200": Chip(141e9 / 2 ** 30, 989e12, 4.8e12),
    "b200": Chip(180e9 / 2 ** 30, 2250e12, 8e12),
    "tpu_v4": Chip(32.0, 275e12, 1228e9), "tpu_v5e": Chip(16.0, 197e12, 819e9),
    "tpu_v5p": Chip(95.0, 459e12, 2765e9), "tpu_v6e": Chip(32.0, 918e12, 1640e9),
}

# TPU generations `hardware.topology` may name -> the chip, and whether its Cloud slice
# names count TensorCores (2 per chip: v4-8 and v5p-8 are 4 chips) or chips (v5e-8, v6e-8).
TPU_GENERATIONS = {"v4": ("tpu_v4", 2, 3), "v5p": ("tpu_v5p", 2, 3),
                   "v5e": ("tpu_v5e", 1, 2), "v5litepod": ("tpu_v5e", 1, 2),
                   "v6e": ("tpu_v6e", 1, 2)}  # name: (chip, cores per chip, torus dims)
# GPUs `hardware.topology` may name -> the XLA target config (configs/gpu_targets/<stem>.txtpb)
# a deviceless compile describes the device with (parallel.topology.gpu_target_config).
GPU_TARGETS = {"h100": "h100_sxm", "h200": "h200"}
GPUS_PER_HOST_MAX, GPU_HOSTS_MAX = 8, 4096  # an NVLink node (HGX: 8 GPUs); hosts: a sanity cap
_TOPOLOGY_ALLOWED = ("'' (none) or a TPU topology: a libtpu name <gen>:<AxBxC> (v4, v5p; "
                     "v5e, v6e: <AxB>) such as 'v5p:2x2x1', or a Cloud slice name <gen>-<N> "
                     "such as 'v5p-256' (N TensorCores for v4 / v5p, chips for v5e / v6e); or "
                     f"GPUs <gpu>:<N> (one host) or <gpu>:<hosts>x<N> with gpu in "
                     f"{'/'.join(GPU_TARGETS)}, N in [1, {GPUS_PER_HOST_MAX}], hosts in "
                     f"[1, {GPU_HOSTS_MAX}], such as 'h100:8' or 'h200:2x8'")


def _slice_shape(chips: int, dims: int) -> list[int]:
  """The torus of `chips` chips (a power of 2) as Cloud TPU slices lay it out: doubling the
  smallest side, from 2x2x1 (3-D) or 1x1 (2-D): 64 -> 4x4x4, 128 -> 4x4x8, 16 -> 4x4."""
  shape = [2, 2, 1] if dims == 3 else [1, 1]
  while math.prod(shape) < chips:
    shape[shape.index(min(shape))] *= 2
  return sorted(shape, key=lambda v: (v == 1, v))  # 2x2x1, 2x2x4, 4x4x8 as Cloud names them


def is_gpu_topology(name: str) -> bool:
  """True for a GPU node name ('h100:8', 'h200:2x8'): its prefix names a GPU_TARGETS chip."""
  return name.split(":", 1)[0] in GPU_TARGETS


def _parse_gpu(name: str, bad: ConfigError) -> tuple[str, str, int]:
  """'h100:8' -> ("h100", "1x1x8", 8); 'h200:2x8' -> ("h200", "1x2x8", 16): jax's GPU
  topology string is partitions x hosts x devices per host."""
  m = re.fullmatch(r"([a-z0-9]+):(?:([0-9]+)x)?([0-9]+)", name)
  if not m:
    raise bad
  chip, hosts, per_host = m.group(1), int(m.group(2) or 1), int(m.group(3))
  if not (1 <= per_host <= GPUS_PER_HOST_MAX and 1 <= hosts <= GPU_HOSTS_MAX):
    raise bad
  return chip, f"1x{hosts}x{per_host}", hosts * per_host


def parse_topology(name: str) -> tuple[str, str, int]:
  """A `hardware.topology` name -> (chip key of CHIPS, the compiler's topology name, chips).

  TPU: 'v5p:2x2x1' passes through (4 chips); 'v5p-256' is the Cloud slice of 256
  TensorCores = 128 chips -> 'v5p:4x4x8' (libtpu's name). GPU: 'h100:8' -> ("h100",
  "1x1x8", 8), 'h100:2x8' (2 hosts of 8) -> ("h100", "1x2x8", 16) (jax's partitions x hosts
  x devices per host). Raises ConfigError naming `hardware.topology` otherwise.
  """
  bad = ConfigError(f"config field `hardware.topology` = {name!r} is invalid: allowed "
                    f"{_TOPOLOGY_ALLOWED}")
  if is_gpu_topology(name):
    return _parse_gpu(name, bad)
  m = re.fullmatch(r"([a-z0-9]+)(?::([0-9]+(?:x[0-9]+)+)|-([0-9]+))", name)
  if not m or m.group(1) not in TPU_GENERATIONS:
    raise bad
  gen, shape, count = m.groups()
  chip, cores, dims = TPU_GENERATIONS[gen]
  if shape:
    sides = [int(v) for v in shape.split("x")]
    if len(sides) != dims or min(sides) < 1:
      raise bad
    return chip, f"{'v5e' if gen == 'v5litepod' else gen}:{shape}", math.prod(sides)
  n = int(count)
  chips = n // cores
  if n % cores or chips < 1 or chips & (chips - 1):
    raise bad
  sides = _slice_shape(chips, dims)
  if math.prod(sides) != chips:   # 'v5p-4': 2 chips, fewer than the smallest torus 2x2x1
    raise bad
  return chip, f"{'v5e' if gen == 'v5litepod' else gen}:{'x'.join(map(str, sides))}", chips


def _topology_ok(name) -> bool:
  try:
    return name == "" or bool(parse_topology(name))
  except ConfigError:
    return False


@dataclasses.dataclass(frozen=True)
class HardwareConfig(Checked):
  """`hardware`: the accelerator a plan targets; the dry run reads it.

  device "" leaves the target unnamed and checks against `memory_gib` (64 GiB when that is
  0 too); a named device takes its memory from CHIPS unless memory_gib is set.
  `margin` is the share of that memory kept free for XLA's scratch buffers, fragmentation
  and the runtime (the plan must fit in (1 - margin) x memory).
  `topology` (a TPU topology or slice name, or GPUs 'h100:8' / 'h200:2x8', see
  `parse_topology`) makes `--dry_run` also compile the steps ahead of time for those devices
  (`hybridmoe_jax/tools/aot.py`: libtpu's compiler, or XLA:GPU's from the CUDA plugin; no
  accelerator needed); it implies `device` (tpu_v5p for 'v5p-256', h100 for 'h100:8').
  """

  PATH = "hardware"
  device: str = ranged("", ("",) + tuple(CHIPS), "'': unnamed")
  memory_gib: float = ranged(0.0, "[0, 1e6]", "GiB; 0: the device's own")
  margin: float = ranged(0.1, "[0, 0.9]", "the share of memory kept free")
  topology: str = ranged("", Allowed(_topology_ok, _TOPOLOGY_ALLOWED))

  def check(self, p: str) -> None:
    if self.topology:
      chip = parse_topology(self.topology)[0]
      require(self.device in ("", chip), f"{p}.device", self.device,
              f"'' or {chip!r} with hardware.topology={self.topology!r}")

  @property
  def chip(self) -> str:
    """The CHIPS key of the target ("" when unnamed): `device`, else the topology's."""
    return self.device or (parse_topology(self.topology)[0] if self.topology else "")

  @property
  def memory_bytes(self) -> float:
    """The device memory in bytes (memory_gib, else the chip's, else 64 GiB)."""
    return (self.memory_gib or (CHIPS[self.chip].memory_gib if self.chip else 64.0)) * 2 ** 30

  @property
  def usable_bytes(self) -> float:
    """Bytes a plan may use per device: (1 - margin) x the device memory."""
    return (1.0 - self.margin) * self.memory_bytes

  def describe(self) -> str:
    name = self.chip or "unnamed device (set hardware.device)"
    where = f" ({self.topology})" if self.topology else ""
    return (f"{name}{where}, {self.memory_bytes / 2 ** 30:.1f} GiB per device, "
            f"{self.margin:.0%} kept free")
