"""What XLA:GPU's compiler says about each kernel it built, read from its own reports.

A deviceless GPU compile (`parallel.topology.gpu_topology_devices`) runs ptxas on this host.
With `XLA_FLAGS` from `compiler_flags(dump_dir)` and the environment `LOG_ENV` (both set
before jax starts):
  * XLA runs ptxas as a subprocess with `-v` and logs its report to stderr
    (subprocess_compilation.cc, verbosity 2): per kernel, registers, stack frame and spill
    bytes (`parse_ptxas`);
  * the dump directory gets each module's thunk sequence: per kernel launch, the grid, threads
    per program and dynamic shared memory (`parse_thunks`).
`kernel_rows` joins the two per kernel and adds the occupancy an H100 / H200 SM allows
(`resident_per_sm`). These are COMPILER REPORTS: no GPU ran anything.
"""

from __future__ import annotations

import dataclasses
import math
import re

# The SM of an H100 / H200 (XLA's target configs, configs/gpu_targets/): 132 SMs, 65,536
# 32-bit registers, 2,048 threads, 228 KiB shared memory (233,472 bytes) per SM, at most
# 32 resident programs (thread blocks) per SM (CUDA's limit for compute capability 9.0).
SM_COUNT, SM_REGISTERS, SM_THREADS, SM_SHARED, SM_BLOCKS = 132, 65536, 2048, 233472, 32
REGISTER_ALLOC_UNIT = 8      # registers are allocated per thread in multiples of 8 ...
WARP_REGISTER_GRANULE = 256  # ... and per warp in units of 256

LOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "subprocess_compilation=2"}


def compiler_flags(dump_dir: str) -> str:
  """XLA_FLAGS for a compile whose kernels `kernel_rows` can report: the thunk sequence
  dumped; ptxas run as a subprocess (neither nvJitLink nor the ptxas library, whose reports
  XLA does not log) with -v."""
  return (f"--xla_dump_to={dump_dir} --xla_gpu_enable_libnvjitlink=false "
          "--xla_gpu_enable_libnvptxcompiler=false --xla_gpu_ptx_compiler_extra_flags=-v")


@dataclasses.dataclass
class PtxasFunction:
  """ptxas -v's report for one kernel (bytes; registers per thread)."""

  name: str
  registers: int = 0
  stack_bytes: int = 0
  spill_store_bytes: int = 0
  spill_load_bytes: int = 0
  static_shared_bytes: int = 0


_PROPS = re.compile(r"Function properties for ([\w$.]+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(text: str) -> dict[str, PtxasFunction]:
  """ptxas -v output (any log lines around it) -> {kernel name: PtxasFunction}.

  ptxas prints, per entry function: "Function properties for NAME", then the line with
  the stack frame and spill bytes, then "Used N registers[, ...][, M bytes smem]". A
  kernel reported twice (compiled by two modules) keeps the last report. Lines that are not
  ptxas's are ignored; a report cut short keeps the fields it has.
  """
  out: dict[str, PtxasFunction] = {}
  current = None
  for line in text.splitlines():
    m = _PROPS.search(line)
    if m:
      current = out[m.group(1)] = PtxasFunction(m.group(1))
      continue
    if current is None:
      continue
    m = _FRAME.search(line)
    if m:
      current.stack_bytes, current.spill_store_bytes, current.spill_load_bytes = map(
          int, m.groups())
      continue
    m = _USED.search(line)
    if m:
      current.registers = int(m.group(1))
      current.static_shared_bytes = int(m.group(2) or 0)
      current = None   # "Used ..." closes a function's report
  return out


@dataclasses.dataclass
class Launch:
  """One kernel launch of XLA:GPU's thunk sequence."""

  name: str
  grid: tuple[int, int, int]
  threads: int          # threads per program (block)
  shared_bytes: int     # dynamic shared memory per program

  @property
  def programs(self) -> int:
    return math.prod(self.grid)


_THUNK = re.compile(r"kCustomKernel\b.*?\]\s+([\w$.]+)\s+grid:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s+"
                    r"threads:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s+shared_memory:\s*(\d+)")


def parse_thunks(text: str) -> list[Launch]:
  """A `*.thunk_sequence.txt` dump -> every kernel launch in order (XLA's own fusions and the
  Triton calls of the Pallas kernels alike); other thunks (copies, collectives) are not
  kernels and are left out."""
  return [Launch(m.group(1), tuple(int(v) for v in m.group(2, 3, 4)),
                 math.prod(int(v) for v in m.group(5, 6, 7)), int(m.group(8)))
          for m in _THUNK.finditer(text)]


def resident_per_sm(registers: int, threads: int, shared_bytes: int) -> int:
  """Programs of this kernel one SM holds at once: the least of what its registers (per
  warp, in 256-register granules), threads, shared memory and the 32-block cap allow."""
  if threads <= 0:
    return 0
  warps = math.ceil(threads / 32)
  per_thread = math.ceil(max(registers, 1) / REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT
  per_warp = math.ceil(per_thread * 32 / WARP_REGISTER_GRANULE) * WARP_REGISTER_GRANULE
  by_regs = SM_REGISTERS // (per_warp * warps)
  by_threads = SM_THREADS // threads
  by_shared = SM_SHARED // shared_bytes if shared_bytes else SM_BLOCKS
  return min(by_regs, by_threads, by_shared, SM_BLOCKS)


def kernel_rows(ptxas_log: str, thunks: str, prefix: str = "") -> list[dict]:
  """One row per launch of a kernel whose name starts with `prefix` (thunk order; "kda_": the
  KDA Pallas kernels): registers, spill bytes, stack, shared memory (dynamic + static),
  grid, programs, programs per SM (programs / 132: below 1, SMs stay idle) and resident
  programs per SM by occupancy. A kernel ptxas did not report this time (compiled earlier
  in the process and reused) has None in ptxas's fields."""
  reports = parse_ptxas(ptxas_log)
  rows = []
  for launch in parse_thunks(thunks):
    name = launch.name
    if not name.startswith(prefix):
      continue
    p = reports.get(name)
    shared = launch.shared_bytes + (p.static_shared_bytes if p else 0)
    rows.append(dict(
        kernel=name, registers=p.registers if p else None,
        spill_store_bytes=p.spill_store_bytes if p else None,
        spill_load_bytes=p.spill_load_bytes if p else None,
        stack_bytes=p.stack_bytes if p else None, shared_bytes=shared,
        grid=list(launch.grid), threads=launch.threads, programs=launch.programs,
        programs_per_sm=round(launch.programs / SM_COUNT, 3),
        resident_per_sm=resident_per_sm(p.registers, launch.threads, shared) if p else None))
  return rows
