"""The fla anchor of the GPU kernel report (benchmarks/fla_anchor_gpu_aot.py, run by its own
venv with torch) and how benchmarks/kda_gpu_aot.py joins its rows: the row a compiled
kernel gives, the tables with fla beside ours, the one-line skip without that venv, and (slow,
only where the venv exists) a real compile of fla's forward for sm_90."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from benchmarks import gpu_kernel_report as gkr
from tests._support import load_file_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ANCHOR = os.path.join(ROOT, "benchmarks", "fla_anchor_gpu_aot.py")
BENCH = os.path.join(ROOT, "benchmarks", "kda_gpu_aot.py")


def _anchor_module():
  """The anchor script as a module (it imports neither torch nor jax at import)."""
  return load_file_module("benchmarks/fla_anchor_gpu_aot.py", "fla_anchor_gpu_aot")


def test_anchor_row_has_the_kernel_report_columns():
  mod = _anchor_module()
  kernel = types.SimpleNamespace(
      name="chunk_kda_fwd_kernel", metadata=types.SimpleNamespace(num_warps=4, shared=16384),
      _ptxas=gkr.PtxasFunction("chunk_kda_fwd_kernel", registers=128, spill_store_bytes=8,
                               spill_load_bytes=12, stack_bytes=16))
  row = mod.Recorder.row(kernel, (128, 4, 16))
  assert row["programs"] == 8192 and row["threads"] == 128
  assert row["programs_per_sm"] == round(8192 / gkr.SM_COUNT, 3)
  assert (row["registers"], row["spill_store_bytes"], row["spill_load_bytes"]) == (128, 8, 12)
  assert row["resident_per_sm"] == gkr.resident_per_sm(128, 128, 16384) == 4
  # A kernel ptxas did not report (cached) keeps the grid, not made-up figures.
  cached = types.SimpleNamespace(name="k", metadata=kernel.metadata)
  assert mod.Recorder.row(cached, (2, 1, 1))["registers"] is None


def _run(args, **kw):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        env=env, timeout=300, **kw)


def test_tables_put_fla_beside_ours(tmp_path):
  base = dict(T=8192, packing="unpacked", mode="fwdbwd")
  ours = dict(base, kernel="kda_states_gpu", registers=162, spill_store_bytes=0,
              spill_load_bytes=0, shared_bytes=32768, grid=[16, 16, 1], programs=256,
              programs_per_sm=1.939, resident_per_sm=3)
  fla = dict(ours, impl="fla", kernel="chunk_gated_delta_rule_fwd_kernel_h", registers=246,
             spill_store_bytes=4, spill_load_bytes=4, grid=[64, 1, 1], programs=64,
             saved_bytes=256 * 2**20)
  program = dict(base, program="kda_fwdbwd_unpacked_8192", temp_bytes=166 * 2**20,
                 tpu_temp_bytes=111 * 2**20, temp_gpu_over_tpu=1.5, kda_kernels=5,
                 xla_kernels=90, compile_s=30.0)
  path = tmp_path / "run.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in (ours, program, fla)) + "\n")
  out = _run([BENCH, "--table", str(path)])
  assert out.returncode == 0, out.stderr[-2000:]
  text = out.stdout
  assert "| ours | 8,192 | unpacked | fwdbwd | `kda_states_gpu` | 162 | 0/0 |" in text
  assert "| fla | 8,192 | unpacked | fwdbwd | `chunk_gated_delta_rule_fwd_kernel_h` |" in text
  assert "| 8,192 | unpacked | fwdbwd | 166.0 | 111.0 | 1.5 |" in text
  assert "| 8,192 | unpacked | fwdbwd | fla | 1 | 8 | 64 | 246 | 256.0 |" in text
  assert "| 8,192 | unpacked | fwdbwd | ours | 1 | 0 | 256 | 162 | - |" in text


def test_missing_fla_venv_is_one_line():
  code = ("import benchmarks.kda_gpu_aot as b; "
          "assert b.start_fla('/nonexistent/venv-fla/bin/python', None) is None; "
          "assert b.start_fla('', None) is None")
  out = _run(["-c", code])
  assert out.returncode == 0, out.stderr[-2000:]
  lines = [x for x in out.stderr.splitlines() if "fla anchor" in x]
  assert lines == ["# fla anchor skipped: /nonexistent/venv-fla/bin/python not found (make "
                   "the venv: benchmarks/fla_anchor_gpu_aot.py's docstring)"]


def _fla_python() -> str | None:
  python = os.environ.get("FLA_PYTHON") or os.path.join(os.path.dirname(ROOT), "venv-fla",
                                                        "bin", "python")
  return python if os.path.exists(python) else None


@pytest.mark.slow
def test_fla_forward_compiles_for_sm90_without_a_gpu():
  python = _fla_python()
  if python is None:
    pytest.skip("no fla venv (FLA_PYTHON or ../venv-fla): fla_anchor_gpu_aot.py's docstring")
  out = subprocess.run([python, ANCHOR, "--T", "1024", "--packing", "unpacked", "--modes",
                        "fwd"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [json.loads(x[5:]) for x in out.stdout.splitlines() if x.startswith("JSON ")]
  assert rows and all(r["impl"] == "fla" and r["source"] == "COMPILER REPORT" for r in rows)
  assert all(r["registers"] for r in rows), rows
  assert any("chunk" in r["kernel"] for r in rows)
