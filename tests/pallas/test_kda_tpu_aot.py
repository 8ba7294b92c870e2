"""The KDA Pallas kernels compiled by libtpu for a TPU v5p chip, without a TPU (deviceless
AOT: jax.experimental.topologies), against the chunked XLA path compiled the same way.

Checks what only the real compiler can: Mosaic compiles the forward and the one-kernel
backward (a tpu_custom_call in the optimised HLO), XLA adds no layout copies of the token
arrays around them, and fwd+bwd temporary memory stays at most the XLA path's
(benchmarks/kda_tpu_aot.py has the full-size figures, BENCHMARKS.md the table).
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybridmoe_jax.ops.kda.chunked import kda_chunked
from hybridmoe_jax.parallel.topology import topology_devices
from pallas_kernels.kda import kda_pallas

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="needs libtpu (pip install 'jax[tpu]') for deviceless TPU AOT"),
    pytest.mark.slow,  # each Mosaic compile of the backward takes ~1 CPU-minute
]

B, T, H, K, V, C = 1, 1024, 2, 128, 128, 64


def _compile(fn, specs):
  mesh = Mesh(np.array(topology_devices("v5p:2x2x1")[:1]).reshape(1), ("x",))
  rep = NamedSharding(mesh, PartitionSpec())
  with jax.set_mesh(mesh):
    return jax.jit(fn, in_shardings=(rep,) * len(specs)).lower(*specs).compile()


def _fwdbwd(run):
  def fn(q, k, v, g, beta, seg):
    loss = lambda *x: jnp.sum(run(*x, seg).astype(jnp.float32))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

  return fn


def test_pallas_fwdbwd_compiles_for_v5p_within_the_xla_paths_memory():
  bf16 = jnp.bfloat16
  specs = [jax.ShapeDtypeStruct((B, T, H, K), bf16), jax.ShapeDtypeStruct((B, T, H, K), bf16),
           jax.ShapeDtypeStruct((B, T, H, V), bf16),
           jax.ShapeDtypeStruct((B, T, H, K), jnp.float32),
           jax.ShapeDtypeStruct((B, T, H), bf16), jax.ShapeDtypeStruct((B, T), jnp.int32)]
  kw = dict(chunk_size=C, lower_bound=-5.0)
  pallas = _compile(_fwdbwd(lambda *x: kda_pallas(
      *x[:5], segment_ids=x[5], backend="tpu", interpret=False, **kw)[0]), specs)
  xla = _compile(_fwdbwd(lambda *x: kda_chunked(*x[:5], segment_ids=x[5], **kw)[0]), specs)
  hlo = pallas.as_text()
  assert hlo.count('custom_call_target="tpu_custom_call"') == 2  # forward, backward
  assert "kda_bwd_packed_tpu" in hlo
  temp = pallas.memory_analysis().temp_size_in_bytes
  assert temp <= xla.memory_analysis().temp_size_in_bytes


def test_the_xla_paths_scan_is_costed_at_every_step():
  """XLA's cost analysis counts a loop body once; benchmarks/kda_tpu_aot.py costs the XLA
  path by compiling its scan body alone and counting it per step. Counted so, its fwd+bwd
  FLOPs match the kernel's (the same math, counted independently: pallas_kernels/kda/
  cost.py), and exceed the program's own loop-once figure."""
  from benchmarks import kda_tpu_aot as bench

  mesh = bench.tpu_mesh("v5p:2x2x1")
  xla = bench.compile_one(mesh, "xla", "fwdbwd", 1024, packed=False)
  kernel = bench.compile_one(mesh, "pallas", "fwdbwd", 1024, packed=False)
  assert xla["scan_costed"] and xla["flops"] == pytest.approx(kernel["flops"], rel=0.05)
  assert xla["flops"] > 2 * xla["flops_loop_once"]
