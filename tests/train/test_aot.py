"""Deviceless TPU AOT compilation (hybridmoe_jax/tools/aot.py): the real steps compiled by libtpu for
a v5p topology on this CPU host, with the implementations chosen for the TPU target.

Skipped, with the reason, when libtpu (the `[tpu]` extra) is not installed. The compile of
the tiny model's three programs takes minutes on a loaded 2-core box: marked slow.
"""

import importlib.util
import re

import jax
import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.hardware import HardwareConfig, parse_topology
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.config.flags import load_config_file

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed: pip install "
                                  "-e \".[tpu]\" brings the TPU compiler")
TOPOLOGY = "v5p:2x2x1"
# Our memory model against the compiler's total for the tiny train step. At this size the
# compiler's fixed costs (code, XLA's scratch) dominate and our model counts none of them:
# the bound is loose here; BENCHMARKS.md keeps the ratios of the real presets.
RATIO_BOUNDS = (0.1, 3.0)


def test_topology_names_resolve_or_fail_in_one_line():
  assert parse_topology("v5p:2x2x1") == ("tpu_v5p", "v5p:2x2x1", 4)
  assert parse_topology("v5p-256") == ("tpu_v5p", "v5p:4x4x8", 128)  # 256 cores, 128 chips
  assert parse_topology("v6e-16") == ("tpu_v6e", "v6e:4x4", 16)
  assert HardwareConfig(topology="v5p-64").chip == "tpu_v5p"
  for bad in ("v5p-6", "v7-8", "v5p:2x2", "h200"):
    with pytest.raises(ConfigError, match=r"hardware\.topology.*v5p:2x2x1") as e:
      HardwareConfig(topology=bad)
    assert "\n" not in str(e.value)
  with pytest.raises(ConfigError, match=r"hardware\.device"):
    HardwareConfig(topology="v5p-8", device="tpu_v6e")


def test_without_libtpu_the_error_says_how_to_install(monkeypatch):
  from hybridmoe_jax.parallel import topology

  real = importlib.util.find_spec
  monkeypatch.setattr(topology.importlib.util, "find_spec",
                      lambda name, *a: None if name == "libtpu" else real(name, *a))
  with pytest.raises(topology.TopologyUnavailable) as e:
    topology.topology_devices(TOPOLOGY)
  msg = str(e.value)
  assert 'pip install -e ".[tpu]"' in msg and f"jax[tpu]=={jax.__version__}" in msg
  assert "\n" not in msg


@needs_libtpu
def test_libtpu_rejection_is_one_line_and_choosers_see_the_target():
  """A name libtpu rejects is a one-line ConfigError; under a mesh of TPU devices every
  chooser picks the TPU implementation although this host is a CPU."""
  from hybridmoe_jax.ops.attention import api as attention_backends
  from hybridmoe_jax.ops.kda import choose
  from hybridmoe_jax.parallel import exchange, topology
  from hybridmoe_jax.parallel.mesh import build_mesh

  with pytest.raises(ConfigError, match=r"hardware\.topology.*libtpu rejects") as e:
    topology.topology_devices("v5p:3x3x3")
  assert "\n" not in str(e.value)
  devices = topology.topology_devices(TOPOLOGY)
  assert len(devices) == 4 and devices[0].platform == "tpu"
  assert jax.default_backend() == "cpu"
  kda_args = dict(head_dim=128, v_head_dim=128, chunk_size=64, lower_bound=-5.0)
  assert choose("auto", **kda_args)[0] == "chunked"           # no mesh: the host
  with jax.set_mesh(build_mesh({"fsdp": 2, "expert": 2}, devices)):
    name, why = choose("auto", **kda_args)[:2]
    assert name == "pallas" and "tpu" in why and "mesh" in why
    assert attention_backends.current_backend() == ("tpu", None)
    assert exchange.resolve_impl("auto") == "native"
  # A mesh axis no product of the slice's physical axes gives (8 on 4 x 4 x 4): one line.
  with pytest.raises(ConfigError, match=r"`mesh`.*physical axes") as e:
    build_mesh({"fsdp": 8, "context": 8}, topology.topology_devices("v5p:4x4x4"))
  assert "\n" not in str(e.value)


def _tiny():
  config = load_config_file("configs/tiny.py")
  config.hardware.topology = TOPOLOGY
  config.mesh.update(data=1, fsdp=2, expert=2)   # the EP shard_map over 2 expert shards
  config.train.update(batch_size=4, seq_len=256)
  return config


@pytest.fixture(scope="module")
def tiny_compiled():
  from hybridmoe_jax.tools import aot

  return aot.compile_run(run_config_from_dict(_tiny()), max_len=256, prefill_chunk=128)


@needs_libtpu
@pytest.mark.slow
def test_tiny_steps_compile_for_v5p_with_pallas_and_ep(tiny_compiled):
  from hybridmoe_jax.tools import aot

  train, prefill, decode = tiny_compiled["programs"]
  assert [p.name.split()[0] for p in (train, prefill, decode)] == ["train", "prefill", "decode"]
  impls = "\n".join(tiny_compiled["impls"])
  assert "(kda): pallas" in impls and "MoE exchange: native" in impls
  # The Pallas KDA kernel compiled through Mosaic, in the train step and the prefill.
  assert aot.MOSAIC_CALL in train.hlo and aot.MOSAIC_CALL in prefill.hlo
  # The expert-parallel exchange: the native collective inside the EP shard_map.
  assert "ragged-all-to-all" in train.hlo and "ragged-all-to-all" in decode.hlo
  for p in (train, prefill, decode):
    m = p.memory
    assert m["total"] > 0 and m["arguments"] > 0 and p.compile_s > 0
    assert p.cost.get("flops", 0) > 0
  lo, hi = RATIO_BOUNDS
  assert lo <= train.model_bytes / train.memory["total"] <= hi, (train.model_bytes,
                                                                 train.memory)
  from hybridmoe_jax.tools import aot_table
  text = aot_table.report(tiny_compiled)
  assert "COMPILER ESTIMATES" in text and "tpu_v5p" in text and "fits" in text
  assert "train stage 0 T=256" in text and "MFU" in text


def test_config_rejects_bad_topology_before_any_compile():
  config = _tiny()
  config.hardware.topology = "v5p-300"
  with pytest.raises(ConfigError, match=r"hardware\.topology"):
    run_config_from_dict(config)


def test_a_program_over_hbm_is_a_row_saying_by_how_much_not_a_crash():
  """libtpu refuses a program whose temporaries exceed HBM (as Kimi K3 at 16 rows per data
  shard does on v5p-2048): the report gets a row with the compiler's figure, over HBM."""
  from hybridmoe_jax.tools import aot

  class Refused:
    def lower(self, *a, **k):
      return self

    def compile(self):
      raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
          "temporaries (795.09G) exceeds available HBM (95.74G).")

  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
  c = aot._compile("train stage 0 T=4,096", Refused(), (), {}, mesh, tokens=8)
  assert "refused" in c.name and c.memory["total"] == pytest.approx(795.09 * 2 ** 30)

  class Other(Refused):
    def compile(self):
      raise jax.errors.JaxRuntimeError("INTERNAL: something else")

  with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
    aot._compile("decode", Other(), (), {}, mesh, tokens=1)


def _curriculum_run():
  config = load_config_file("configs/curriculum_1m.py")
  config.hardware.update(device="", topology="v5p-32")
  return run_config_from_dict(config)


def test_aot_stages_picks_stages_by_index_or_name_in_plan_order():
  from hybridmoe_jax.tools import aot
  from hybridmoe_jax.train import stage_plan as plan_lib

  plan = plan_lib.build_plan(_curriculum_run())
  assert aot.select_stages(plan, "") == plan.stages
  assert [s.name for s in aot.select_stages(plan, "1m,0")] == ["8k", "1m"]
  assert [s.index for s in aot.select_stages(plan, "64k, 2")] == [1, 2]
  for bad in ("4", "2m", ",", "0,,1"):
    with pytest.raises(ConfigError, match=r"--aot_stages.*'1m'") as e:
      aot.select_stages(plan, bad)
    assert "\n" not in str(e.value)


def test_aot_layers_beyond_the_model_depth_is_refused_before_any_compile(monkeypatch):
  """--aot_layers=A,B compiles B layers of the model's pattern: B above model.num_layers
  is a one-line error naming the flag, before the topology's devices or any compile (was: a
  compile at A layers, then an error about model.layer_kinds)."""
  from hybridmoe_jax.tools import aot

  monkeypatch.setattr(aot.topology, "topology_devices",
                      lambda *a: pytest.fail("reached the topology before checking the flag"))
  run = run_config_from_dict(_tiny())
  for layers in ((2, run.model.num_layers + 1), (3, 3), (0, 2)):
    with pytest.raises(ConfigError, match=r"--aot_layers=.*model\.num_layers=4") as e:
      aot.compile_run(run, layers=layers)
    assert "\n" not in str(e.value)


@needs_libtpu
def test_compile_run_compiles_only_the_picked_stages_and_no_serving(monkeypatch):
  """--aot_stages=1m --noaot_serve: one train step (the 1M stage's shapes), no prefill or
  decode; our memory model's figure is that stage's. The compiler is stubbed (seconds)."""
  from hybridmoe_jax.tools import aot

  seen = []

  def fake_compile(name, fn, args, kwargs, mesh, tokens, where=None):
    seen.append((name, args[1]["tokens"].shape, dict(mesh.shape)))
    memory = {k: 1.0 for k in ("arguments", "outputs", "aliased", "temporaries", "code")}
    memory["total"] = 4.0
    return aot.Compiled(name=name, tokens=tokens, compile_s=1.0, memory=memory, cost={})

  monkeypatch.setattr(aot, "_compile", fake_compile)
  result = aot.compile_run(_curriculum_run(), stages="1m", serve=False)
  assert [p.name for p in result["programs"]] == ["train stage 3 T=1,048,576"]
  assert seen[0][1] == (4, 1 << 20) and seen[0][2]["context"] == 4
  # stage 3: 69.13 GiB by our plan (74.15 before the MoE intermediates went to the compute dtype)
  assert result["programs"][0].model_bytes > 65 * 2 ** 30
  seen.clear()
  result = aot.compile_run(_curriculum_run(), stages="0,1m", serve=False, layers=(2, 4))
  assert [p.name.split(" T=")[0] for p in result["programs"]] == ["train stage 0",
                                                                  "train stage 3"]
  assert len(seen) == 4  # two stages at 2 and at 4 layers


def _tiny_accum(grad_accum: int, batch_size: int = 8):
  config = _tiny()
  config.train.update(batch_size=batch_size, grad_accum=grad_accum)
  return run_config_from_dict(config)


@needs_libtpu
def test_memory_only_compiles_each_step_once_and_reports_no_step_time(monkeypatch):
  """--noaot_cost (`cost=False`): the accumulation loop is not compiled again unrolled, and
  the row says nothing about time rather than a loop-undercounted one. Compiler stubbed."""
  from hybridmoe_jax.tools import aot

  calls = []

  def fake_compile(name, fn, args, kwargs, mesh, tokens, where=None):
    calls.append(name)
    memory = {k: 1.0 for k in ("arguments", "outputs", "aliased", "temporaries", "code")}
    return aot.Compiled(name=name, tokens=tokens, compile_s=1.0, memory=dict(memory, total=4.0),
                        cost={"flops": 13.0, "bytes accessed": 120.0, "optimal_seconds": 1.0})

  monkeypatch.setattr(aot, "_compile", fake_compile)
  train, = aot.compile_run(_tiny_accum(4), serve=False, cost=False)["programs"]
  assert len(calls) == 1 and train.memory["total"] == 4.0
  assert aot.step_seconds(train, "tpu_v5p") == (None, "n/a")


@needs_libtpu
def test_accumulation_loop_costed_from_an_unrolled_copy_and_missed_mixer_flops_added(
    monkeypatch):
  """XLA's cost analysis counts a loop body once (measured: a grad_accum=4 step's flops were
  0.29 of the same batch at 1), so a step with grad_accum is compiled again with the loop
  unrolled twice and the difference, one microbatch, counted grad_accum - 1 more times.
  Splash attention carries no cost estimate: our count of it is added. Compiler stubbed."""
  from hybridmoe_jax.tools import aot

  calls = []

  def fake_compile(name, fn, args, kwargs, mesh, tokens, where=None):
    calls.append(name)   # outside the loop 10 (flops) / 100 (bytes), one microbatch 3 / 20
    n = len(calls)
    memory = {k: 1.0 for k in ("arguments", "outputs", "aliased", "temporaries", "code")}
    return aot.Compiled(name=name, tokens=tokens, compile_s=1.0, memory=dict(memory, total=4.0),
                        cost={"flops": 10.0 + 3.0 * n, "bytes accessed": 100.0 + 20.0 * n,
                              "optimal_seconds": -30.0})

  monkeypatch.setattr(aot, "_compile", fake_compile)
  train, = aot.compile_run(_tiny_accum(4), serve=False)["programs"]
  assert len(calls) == 2 and train.cost == {"flops": 22.0, "bytes accessed": 180.0}
  # MLA (1 layer, 2 heads, qk 24 + v 16 dims) as splash: T^2 H (qk + v) per row forward,
  # x 3.5 with the backward (remat none), 8 rows over 4 chips.
  assert train.extra_flops == pytest.approx(256 ** 2 * 2 * 40 * 3.5 * 8 / 4)
  secs, how = aot.step_seconds(train, "tpu_v5p")
  assert how == "roofline + our count" and secs >= train.extra_flops / 459e12
  calls.clear()
  result = aot.compile_run(_tiny_accum(1), serve=False)
  assert len(calls) == 1 and result["programs"][0].cost["flops"] == 13.0  # no loop: as is
  assert any(l.startswith("train: ") and "(mla): Pallas splash" in l for l in result["impls"])
  assert any(l.startswith("serve: ") for l in result["impls"])


@needs_libtpu
@pytest.mark.slow
def test_accumulated_step_costs_what_one_big_batch_costs(monkeypatch):
  """The loop correction against the compiler itself: tiny, batch 16 on 4 batch shards,
  grad_accum 4 (each microbatch one row per shard) vs 1. The corrected figure (rolled + 2x
  unrolled compiles) equals the compile with all 4 microbatches unrolled (no loop for
  cost_analysis to count once), and what one batch of 16 costs. Measured 2026-12-08
  (libtpu 0.0.50.1): flops 2.334e9 corrected, 2.333e9 unrolled, 2.330e9 one batch; bytes
  7.20e9, 7.15e9, 7.13e9. (At batch 8 a microbatch of 2 rows fills half the shards and
  libtpu's program really does 1.65x the flops: the unrolled compile says the same.)"""
  from hybridmoe_jax.tools import aot

  one, four = (aot.compile_run(_tiny_accum(g, 16), serve=False)["programs"][0] for g in (1, 4))
  monkeypatch.setattr(aot, "_smallest_divisor", lambda n: n)   # unroll all 4: no loop
  unrolled = aot.compile_run(_tiny_accum(4, 16), serve=False)["programs"][0]
  for k, tol in (("flops", 0.02), ("bytes accessed", 0.05)):
    assert abs(four.cost[k] / unrolled.cost[k] - 1) <= tol, (k, four.cost, unrolled.cost)
  assert 0.9 <= four.cost["flops"] / one.cost["flops"] <= 1.1, (four.cost, one.cost)
  assert 0.9 <= four.cost["bytes accessed"] / one.cost["bytes accessed"] <= 1.25


def _expert_collective_dtypes(hlo: str, experts: int, widths: set[int]) -> set[str]:
  """Dtypes of the all-gathers / all-reduces / reduce-scatters of routed-expert-shaped
  arrays ([E, n, I] or [E, I, n]: the weights or their gradients)."""
  out = set()
  for m in re.finditer(r"= (\w+)\[(\d+),(\d+),(\d+)\][^ ]* (all-gather|all-reduce|reduce-scatter)\(",
                       hlo):
    if int(m.group(2)) == experts and {int(m.group(3)), int(m.group(4))} == widths:
      out.add(m.group(1))
  return out


@needs_libtpu
@pytest.mark.slow
def test_expert_weights_gathered_in_the_compute_dtype_when_cast_on_their_shards():
  """compute.moe_weight_cast: "sharded" moves the routed experts and their gradients in bf16
  only; "gathered" moves them in fp32 too (the comparison this knob exists for)."""
  from hybridmoe_jax.tools import aot

  seen = {}
  for cast in ("sharded", "gathered"):
    config = _tiny()
    config.compute.update(dtype="bfloat16", moe_weight_cast=cast)
    config.mesh.update(fsdp=4, expert=1)
    m = config.model.moe
    train, = aot.compile_run(run_config_from_dict(config), serve=False, cost=False)["programs"]
    seen[cast] = _expert_collective_dtypes(train.hlo, m.num_experts,
                                           {m.latent_dim, m.expert_intermediate})
  assert seen["sharded"] == {"bf16"}, seen
  assert "f32" in seen["gathered"], seen
