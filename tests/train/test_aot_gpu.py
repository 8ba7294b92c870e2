"""Deviceless GPU AOT compilation (hybridmoe_jax/tools/aot.py on 'h100:8' / 'h200:2x8'): the real
steps compiled by XLA:GPU from jax's CUDA plugin on this CPU host, for XLA's H100 / H200
target configs (configs/gpu_targets/).

The CUDA plugin can only describe GPUs when jax's platforms are "cpu" before any backend
starts, and this test process's backend started at conftest: the compiles run in a
subprocess. Skipped, with the reason, without the plugin (the `[gpu]` extra).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.hardware import GPU_TARGETS, HardwareConfig, parse_topology
from hybridmoe_jax.parallel import topology

ROOT = pathlib.Path(__file__).resolve().parents[2]
needs_plugin = pytest.mark.skipif(not topology.has_cuda_plugin(), reason=(
    "jax's CUDA plugin not installed: pip install -e \".[gpu]\" brings XLA:GPU and ptxas"))


def test_gpu_node_names_parse_or_fail_in_one_line():
  assert parse_topology("h100:8") == ("h100", "1x1x8", 8)
  assert parse_topology("h200:2x8") == ("h200", "1x2x8", 16)   # 2 hosts of 8
  assert HardwareConfig(topology="h100:8").chip == "h100"
  assert HardwareConfig(topology="h200:1").memory_bytes == pytest.approx(141e9)
  for bad in ("h100:9", "h100:0", "h100:0x8", "h100:2x8x1", "h100", "h300:8", "h100-8"):
    with pytest.raises(ConfigError, match=r"hardware\.topology.*h100:8") as e:
      HardwareConfig(topology=bad)
    assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match=r"hardware\.device"):
    HardwareConfig(topology="h100:8", device="h200")


def test_target_configs_are_in_the_repo_with_their_source():
  for chip, stem in GPU_TARGETS.items():
    text = topology.gpu_target_config(chip)
    assert f"specs/{stem}.txtpb" in text and "openxla/xla" in text   # the source, named
    assert "core_count: 132" in text and 'platform_name: "CUDA"' in text


def test_without_the_plugin_the_error_says_how_to_install(monkeypatch):
  monkeypatch.setattr(topology, "has_cuda_plugin", lambda: False)
  with pytest.raises(topology.TopologyUnavailable) as e:
    topology.topology_devices("h100:8")
  msg = str(e.value)
  assert 'pip install -e ".[gpu]"' in msg and "jax[cuda12]==" in msg and "\n" not in msg


@needs_plugin
def test_with_a_started_non_cpu_backend_choice_the_error_says_what_to_set(monkeypatch):
  """The plugin looks for a GPU unless jax's platforms are "cpu": a one-line error, not
  the plugin's 'topology not implemented for cuda'."""
  monkeypatch.setattr(topology, "_platforms", lambda: "")
  with pytest.raises(topology.TopologyUnavailable, match="JAX_PLATFORMS=cpu") as e:
    topology.topology_devices("h100:8")
  assert "\n" not in str(e.value)


def test_gpu_step_time_is_our_roofline_not_a_cost_model():
  """No cost analysis on GPU: the time is max(our FLOPs / peak, the compiler's argument +
  output bytes / HBM bandwidth)."""
  from hybridmoe_jax.config.hardware import CHIPS
  from hybridmoe_jax.tools import aot

  memory = {"arguments": 3.35e9, "outputs": 3.35e9, "aliased": 0.0, "temporaries": 1.0,
            "code": 0.0, "total": 6.7e9}
  c = aot.Compiled(name="train", tokens=8, compile_s=1.0, memory=memory, cost={},
                   model_flops=989e12 * 1.5, extra_flops=989e12 * 0.5)
  assert aot.step_seconds(c, "h100") == (pytest.approx(2.0), "our roofline")
  c.model_flops, c.extra_flops = 1.0, 0.0   # bandwidth-bound: 6.7 GB at 3.35 TB/s
  assert aot.step_seconds(c, "h100")[0] == pytest.approx(6.7e9 / CHIPS["h100"].hbm_bytes_per_s)
  c.model_flops = None
  assert aot.step_seconds(c, "h100") == (None, "n/a")


_COMPILE_TINY = r"""
import json, sys
from hybridmoe_jax.config.flags import load_config_file
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.tools import aot, aot_table

config = load_config_file("configs/tiny.py")
config.hardware.topology = sys.argv[1]
config.mesh.update(data=1, fsdp=2, expert=int(sys.argv[2]))
config.train.update(batch_size=int(sys.argv[3]), seq_len=256)
result = aot.compile_run(run_config_from_dict(config), max_len=256, prefill_chunk=128)
text = aot_table.report(result)
print("RESULT " + json.dumps({
    "report": text, "impls": result["impls"], "devices": result["devices"],
    "programs": [{"name": p.name, "triton": p.hlo.count(aot.TRITON_CALL),
                  "ragged": p.hlo.count("ragged-all-to-all"), "memory": p.memory,
                  "model_bytes": p.model_bytes, "secs": aot.step_seconds(p, result["chip"])}
                 for p in result["programs"]]}))
"""


def _compile_tiny(name: str, expert: int, batch: int) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  env.pop("XLA_FLAGS", None)   # the suite's 8 simulated CPU devices: not wanted here
  proc = subprocess.run([sys.executable, "-c", _COMPILE_TINY, name, str(expert), str(batch)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  return json.loads(lines[-1][len("RESULT "):])


@needs_plugin
@pytest.mark.slow
def test_tiny_steps_compile_for_8_h100s_with_triton_kernels_and_ragged_all_to_all():
  """The acceptance's form (fsdp 2 x expert 4 on h100:8): the KDA kernel and MLA's flash
  attention compile to Triton calls, the expert-parallel exchange to XLA:GPU's ragged
  all-to-all; the table has every program, compiler memory against HBM and our model."""
  out = _compile_tiny("h100:8", expert=4, batch=8)
  train, prefill, decode = out["programs"]
  assert out["devices"] == 8
  impls = "\n".join(out["impls"])
  assert "(kda): pallas" in impls and "Pallas Triton flash attention" in impls
  assert "MoE exchange: native" in impls and "on gpu" in impls
  assert train["triton"] >= 3 and prefill["triton"] >= 2   # KDA fwd/bwd kernels, attention
  assert train["ragged"] > 0 and decode["ragged"] > 0
  for p in out["programs"]:
    assert p["memory"]["total"] > 0 and p["secs"][1] == "our roofline" and p["secs"][0] > 0
  assert 0.1 <= train["model_bytes"] / train["memory"]["total"] <= 3.0
  text = out["report"]
  assert "COMPILER ESTIMATES" in text and "XLA:GPU" in text and "OUR ESTIMATE" in text
  assert "8 x h100" in text and "MFU" in text and "of HBM" in text


@needs_plugin
@pytest.mark.slow
def test_two_hosts_of_8_h200s_compile():
  """The multi-host form: 'h200:2x8' is 16 devices over 2 processes, one mesh over all."""
  out = _compile_tiny("h200:2x8", expert=8, batch=16)
  assert out["devices"] == 16 and "16 x h200" in out["report"]
  assert out["programs"][0]["ragged"] > 0
