"""The anchor for benchmarks/kda_gpu_aot.py: flash-linear-attention's Triton `chunk_kda` kernels
compiled for an H100 (sm_90) by Triton itself on a CPU-only machine, with ptxas's report.

Runs in its own virtual environment (fla needs torch; this project does not):

    python3.11 -m venv /work/venv-fla
    /work/venv-fla/bin/pip install torch==2.13.0          # the CPU build (never a CUDA one)
    /work/venv-fla/bin/pip install -c <(echo torch==2.13.0) triton fla-core
    /work/venv-fla/bin/python benchmarks/fla_anchor_gpu_aot.py --T 8192

(seen working: torch 2.13.0+cpu, triton 3.9.0, fla-core 0.6.0). kda_gpu_aot.py --fla PYTHON
runs this script and prints its rows beside ours.

How, with no GPU: Triton's active driver is replaced by a stand-in that reports an H100
(`GPUTarget("cuda", 90, 32)`, 132 SMs, 228 KiB shared memory per SM) and torch.cuda's device
queries answer the same, so fla's own Python runs `chunk_kda` forward and backward on CPU
tensors; every kernel launch becomes a compile (Triton's `warmup`: compiled, never run), and
the grid fla computed for it is recorded. Triton runs ptxas with -v (TRITON_DUMP_PTXAS_LOG):
registers, stack and spill bytes per kernel. fla's autotuner times its configs on a GPU;
here each candidate config is compiled and the autotuner is handed a score instead of a
time: fewest spill bytes, then most warps resident per SM (a rule of ours, stated in every
row as `config_rule`). Shapes as kda_gpu_aot.py: B=1, H=HV=16, K=V=128, q/k/v/beta bf16,
gates fp32 in [-5, 0) with fla's `safe_gate=True, lower_bound=-5` (its bounded-gate path),
chunk 64. Packed: `cu_seqlens` of documents of 1,024 tokens (fla's varlen form).

Output: one line per kernel launch, prefixed "JSON ", with kda_gpu_aot.py's kernel columns
(gpu_kernel_report.py's occupancy rule) and `saved_bytes`: the bytes of the tensors
fla's autograd saves for the backward (counted from their shapes, not a compiler figure).
COMPILER REPORTS: nothing ran on a GPU. No fla code is copied here; it is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
# The report's parser and occupancy rule, loaded by path: this venv has no jax (the module
# imports none) and does not have this checkout on its path.
_spec = importlib.util.spec_from_file_location(
    "gpu_kernel_report", os.path.join(_HERE, "gpu_kernel_report.py"))
gkr = sys.modules["gpu_kernel_report"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gkr)

H100 = dict(name="NVIDIA H100 80GB HBM3", capability=(9, 0), sms=gkr.SM_COUNT,
            shared_per_sm=gkr.SM_SHARED, shared_optin=232448 - 1024,
            memory=80 * 2**30)
CONFIG_RULE = "autotune by compiler report: fewest spill bytes, then most resident warps/SM"


def _fake_h100(torch):
  """torch.cuda's device queries answer for one H100 (fla reads them at import)."""
  props = types.SimpleNamespace(
      name=H100["name"], major=9, minor=0, multi_processor_count=H100["sms"],
      shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=H100["shared_optin"],
      shared_memory_per_multiprocessor=H100["shared_per_sm"], total_memory=H100["memory"],
      warp_size=32, regs_per_multiprocessor=gkr.SM_REGISTERS)
  cuda = torch.cuda
  cuda.get_device_name = lambda *a, **k: H100["name"]
  cuda.get_device_capability = lambda *a, **k: H100["capability"]
  cuda.get_device_properties = lambda *a, **k: props
  cuda.device_count = lambda: 1
  cuda.current_device = lambda: 0


def _install_driver():
  """Triton's active driver -> a compile-only H100 (no CUDA library is touched)."""
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.driver import CudaDriver
  from triton.runtime import driver

  class _Utils:
    def get_device_properties(self, device):
      del device
      return dict(max_shared_mem=H100["shared_optin"], multiprocessor_count=H100["sms"],
                  max_num_regs=gkr.SM_REGISTERS, warpSize=32, sm_clock_rate=1980000,
                  mem_clock_rate=2619000, mem_bus_width=5120)

  class CompileOnlyH100(CudaDriver):
    def __init__(self):  # CudaDriver's would load libcuda
      self.utils = _Utils()
      self.launcher_cls = None

    def get_current_target(self):
      return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
      return 0

    def get_current_stream(self, device=None):
      return 0

    def get_device_capability(self, device=None):
      return H100["capability"]

    def get_active_torch_device(self):
      import torch
      return torch.device("cpu")

    @staticmethod
    def is_active():
      return True

  driver.set_active(CompileOnlyH100())


class Recorder:
  """Patches Triton's JITFunction.run (every launch -> a compile, its grid recorded) and
  Autotuner._bench (a config's score from its compiler report instead of a timing)."""

  def __init__(self):
    self.rows: list[dict] = []
    self.benching = False

  def install(self):
    from triton.runtime import autotuner, jit
    orig_run = jit.JITFunction.run
    rec = self

    def run(fn, *args, grid, warmup, **kwargs):
      del warmup
      out = io.StringIO()
      with contextlib.redirect_stdout(out):   # TRITON_DUMP_PTXAS_LOG prints ptxas -v
        kernel = orig_run(fn, *args, grid=grid, warmup=True, **kwargs)
      reports = gkr.parse_ptxas(out.getvalue())
      if reports:                             # compiled now (else cached: its report kept)
        kernel._ptxas = next(iter(reports.values()))
      if not rec.benching:
        meta = dict(zip(fn.arg_names, args), **kwargs)
        g = grid(meta) if callable(grid) else grid
        rec.rows.append(rec.row(kernel, tuple(g) + (1,) * (3 - len(g))))
      return kernel

    def bench(tuner, *args, config, **meta):
      current = dict(meta, **config.all_kwargs())
      rec.benching = True
      try:
        kernel = tuner.fn.run(*args, **current)
      except Exception:  # noqa: BLE001  (a config that does not compile never wins)
        return [float("inf")] * 3
      finally:
        rec.benching = False
      p = getattr(kernel, "_ptxas", None)
      if p is None:
        return [float("inf")] * 3
      warps = kernel.metadata.num_warps
      resident = gkr.resident_per_sm(p.registers, warps * 32, kernel.metadata.shared)
      return [float(p.spill_store_bytes + p.spill_load_bytes), -float(resident * warps), 0.0]

    jit.JITFunction.run = run
    autotuner.Autotuner._bench = bench

  @staticmethod
  def row(kernel, grid) -> dict:
    p = getattr(kernel, "_ptxas", None)
    threads = kernel.metadata.num_warps * 32
    shared = kernel.metadata.shared + (p.static_shared_bytes if p else 0)
    programs = grid[0] * grid[1] * grid[2]
    return dict(kernel=kernel.name, registers=p.registers if p else None,
                spill_store_bytes=p.spill_store_bytes if p else None,
                spill_load_bytes=p.spill_load_bytes if p else None,
                stack_bytes=p.stack_bytes if p else None, shared_bytes=shared,
                grid=list(grid), threads=threads, programs=programs,
                programs_per_sm=round(programs / gkr.SM_COUNT, 3),
                resident_per_sm=(gkr.resident_per_sm(p.registers, threads, shared)
                                 if p else None))


def run_fla(recorder: Recorder, T: int, packed: bool, mode: str) -> tuple[list[dict], int]:
  """fla's chunk_kda at the benchmark's shapes; -> (launch rows, saved bytes)."""
  import torch
  from fla.ops.kda import chunk_kda

  B, H, K, V, lb = 1, 16, 128, 128, -5.0
  bf16 = torch.bfloat16
  q = torch.zeros(B, T, H, K, dtype=bf16, requires_grad=True)
  k = torch.zeros(B, T, H, K, dtype=bf16, requires_grad=True)
  v = torch.zeros(B, T, H, V, dtype=bf16, requires_grad=True)
  g = torch.full((B, T, H, K), lb / 2, dtype=torch.float32, requires_grad=True)
  beta = torch.full((B, T, H), 0.5, dtype=bf16, requires_grad=True)
  kw = {}
  if packed:  # documents of 1,024 tokens (fla's varlen form needs B = 1)
    kw["cu_seqlens"] = torch.arange(0, T + 1, 1024, dtype=torch.long)
    kw["cu_seqlens_cpu"] = kw["cu_seqlens"]
  saved = {}

  def pack(t):
    saved[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
    return t

  start = len(recorder.rows)
  with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    o, _ = chunk_kda(q, k, v, g, beta, scale=K ** -0.5, safe_gate=True, lower_bound=lb,
                     **kw)
  fwd_rows = len(recorder.rows) - start
  if mode == "fwdbwd":
    o.backward(torch.zeros_like(o))
  rows = recorder.rows[start:]
  for i, r in enumerate(rows):
    r.update(pass_="fwd" if i < fwd_rows else "bwd")
  return rows, sum(saved.values())


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
  p.add_argument("--packing", nargs="+", default=["unpacked", "packed"],
                 choices=["unpacked", "packed"])
  p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
  a = p.parse_args(argv)
  os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
  # Compile, never take Triton's disk cache: a cached kernel comes with no ptxas report.
  os.environ["TRITON_ALWAYS_COMPILE"] = "1"
  try:
    import torch
    import triton
  except ImportError as e:
    raise SystemExit(f"fla anchor: needs torch and triton in this venv ({e}); see the "
                     "module docstring") from e
  if torch.version.cuda is not None:
    print("# note: a CUDA build of torch; the CPU build suffices", file=sys.stderr)
  _fake_h100(torch)
  _install_driver()
  recorder = Recorder()
  recorder.install()
  try:
    import fla
  except ImportError as e:
    raise SystemExit(f"fla anchor: flash-linear-attention is not installed ({e})") from e
  print(f"# fla {getattr(fla, '__version__', '?')}, triton {triton.__version__}, torch "
        f"{torch.__version__}: chunk_kda compiled for sm_90 (no GPU)", file=sys.stderr)
  for T in a.T:
    for packing in a.packing:
      for mode in a.modes:
        rows, saved = run_fla(recorder, T, packing == "packed", mode)
        for r in rows:
          r.update(program=f"fla_{mode}_{packing}_{T}", impl="fla", mode=mode, T=T,
                   packing=packing, saved_bytes=saved, config_rule=CONFIG_RULE,
                   source="COMPILER REPORT")
          print("JSON " + json.dumps(r), flush=True)


if __name__ == "__main__":
  main()
