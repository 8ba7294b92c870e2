"""The compiler-report parsers of benchmarks/gpu_kernel_report.py (what
benchmarks/kda_gpu_aot.py prints per kernel), on text in the form XLA:GPU and ptxas write it."""

import pytest

from benchmarks import gpu_kernel_report as gkr

# XLA's log of a ptxas -v run (ptx_compiler_helpers.cc) for two kernels, one spilling, with
# unrelated log lines around and between them.
PTXAS_LOG = """\
I1207 00:39:12.955679   24929 nvptx_compiler.cc:625] CompileToPtx for jit_f time: 45.9 s
I1207 00:39:33.410789   24929 ptx_compiler_helpers.cc:132] ptxas warning : Registers are spilled to local memory in function 'kda_fwd_gpu', 6918 bytes spill stores, 9096 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kda_fwd_gpu' for 'sm_90a'
ptxas info    : Function properties for kda_fwd_gpu
ptxas         .     2760 bytes stack frame, 6918 bytes spill stores, 9096 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compile time = 19271.758 ms
I1207 00:39:33.411023   24929 nvptx_compiler.cc:685] PtxToCubin for jit_f time: 20.5 s
ptxas info    : Compiling entry function 'kda_states_gpu' for 'sm_90a'
ptxas info    : Function properties for kda_states_gpu
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem
"""

THUNKS = """\
001: kCustomKernel [source       | next=007 (6)] input_transpose_fusion grid: [32, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
007: kCustomKernel [prev=006 (1) | next=008 (1)] kda_fwd_gpu grid: [1, 16, 2] threads: [256, 1, 1]  shared_memory: 33792 bytes
008: kCopy [prev=007 (1) | sink        ] copy.3
009: kCustomKernel [prev=008 (1) | sink        ] kda_states_gpu grid: [16, 8, 1] threads: [128, 1, 1]  shared_memory: 16384 bytes
"""


def test_ptxas_report_per_kernel():
  got = gkr.parse_ptxas(PTXAS_LOG)
  assert set(got) == {"kda_fwd_gpu", "kda_states_gpu"}
  fwd, st = got["kda_fwd_gpu"], got["kda_states_gpu"]
  assert (fwd.registers, fwd.stack_bytes, fwd.spill_store_bytes, fwd.spill_load_bytes,
          fwd.static_shared_bytes) == (255, 2760, 6918, 9096, 0)
  assert (st.registers, st.spill_store_bytes, st.static_shared_bytes) == (168, 0, 1024)


def test_ptxas_report_cut_short_or_absent_keeps_what_it_has():
  assert gkr.parse_ptxas("") == {}
  assert gkr.parse_ptxas("ptxas info    : Used 40 registers") == {}   # no function named
  cut = "ptxas info    : Function properties for k1\nptxas info    : Used 40 registers\n"
  assert gkr.parse_ptxas(cut)["k1"].registers == 40
  assert gkr.parse_ptxas(cut)["k1"].spill_store_bytes == 0


def test_thunks_list_every_kernel_launch_in_order():
  launches = gkr.parse_thunks(THUNKS)
  assert [l.name for l in launches] == ["input_transpose_fusion", "kda_fwd_gpu",
                                        "kda_states_gpu"]
  fwd = launches[1]
  assert fwd.grid == (1, 16, 2) and fwd.threads == 256 and fwd.shared_bytes == 33792
  assert fwd.programs == 32


def test_kernel_rows_join_the_reports_and_count_occupancy():
  rows = gkr.kernel_rows(PTXAS_LOG, THUNKS, prefix="kda_")
  assert [r["kernel"] for r in rows] == ["kda_fwd_gpu", "kda_states_gpu"]
  fwd, st = rows
  assert fwd["spill_store_bytes"] == 6918 and fwd["programs"] == 32
  assert fwd["programs_per_sm"] == pytest.approx(32 / 132, abs=1e-3)
  # 255 registers -> 256 per thread x 256 threads = the whole 64K register file: 1 per SM.
  assert fwd["resident_per_sm"] == 1
  # 168 x 128 threads = 21,504 registers: 3 per SM; shared memory (16 KiB + 1 KiB) allows 13.
  assert st["shared_bytes"] == 16384 + 1024 and st["resident_per_sm"] == 3
  # A kernel without a ptxas report this time: None, not a made-up zero.
  other = gkr.kernel_rows("", THUNKS, prefix="kda_states")
  assert other[0]["registers"] is None and other[0]["resident_per_sm"] is None


def test_occupancy_limits():
  assert gkr.resident_per_sm(32, 128, 0) == 16                     # threads: 2048 / 128
  assert gkr.resident_per_sm(16, 32, 0) == gkr.SM_BLOCKS             # the 32-block cap
  assert gkr.resident_per_sm(64, 128, 100_000) == 2                  # shared memory
  assert gkr.resident_per_sm(100, 0, 0) == 0
