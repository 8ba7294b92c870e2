"""Two terms of the dry run's step memory read off libtpu's programs (issue 44): the
compute-dtype copy of the scanned layers' weights, and the expert-parallel receive buffers
at their compiled size."""

import dataclasses
import math

import pytest

from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.parallel.ep_moe import buffer_rows
from hybridmoe_jax.train import dry_run, stage_plan
from tests.conftest import load_config


def _components(scan: bool, layers: int = 8, **mesh):
  config = load_config("tiny")
  config.model.num_layers = layers           # 8: 4 leading layers + 1 repeat of 3 KDA + 1 MLA
  config.compute.scan_layers = scan
  config.compute.dtype = "bfloat16"
  config.compute.remat = "full"               # one MoE layer recomputed at a time
  config.mesh.update(data=1, fsdp=1, expert=1, tensor=1, context=1)
  config.mesh.update(**mesh)
  run = run_config_from_dict(config)
  plan = stage_plan.build_plan(run)
  e = dry_run.estimate(run, plan)
  s = plan.stages[0]
  return run, e, dry_run.stage_memory(run, e, s.seq_len, s.batch_size)[run.compute.remat]


@pytest.mark.slow  # traces the scanned stack for the residual count: minutes on 2 loaded cores
def test_scanned_weight_copy_is_half_the_scanned_layers_fp32_bytes():
  run, e, scanned = _components(True)
  unscanned = dataclasses.replace(run, compute=dataclasses.replace(run.compute,
                                                                   scan_layers=False))
  s = stage_plan.build_plan(unscanned).stages[0]
  assert dry_run.stage_memory(unscanned, e, s.seq_len, s.batch_size)["full"][
      "scan_weight_copy"] == 0.0
  # Layers 4..7 are scanned: 4 of the 8 layers; the copy is bf16 of their fp32 weights.
  split = dry_run.layer_split(run.model)
  assert list(split.scanned) == list(range(4, 8))
  layer = e["per_device_scanned_param_bytes"]
  assert 0 < layer < e["per_device_param_bytes"]
  assert scanned["scan_weight_copy"] == pytest.approx(layer / 2)
  # It is model state: more devices shrink it, grad_accum does not.
  assert "scan_weight_copy" in dry_run.STATE_COMPONENTS


def test_ep_buffers_count_the_rows_beyond_the_balanced_ones():
  run, e, comps = _components(False, layers=2, expert=2)   # a dense layer, then a MoE one
  cfg, moe = run.model, run.model.moe
  tokens = dry_run.batch_rows(e["mesh"], run.train.batch_size, run.train.grad_accum) \
      * run.train.seq_len
  a = int(tokens) * moe.experts_per_token
  per_row = (2 * (moe.latent_dim or cfg.d_model) + 3 * moe.expert_intermediate) * 2 * 2
  assert comps["ep_buffers"] == pytest.approx((buffer_rows(a, 2, 0.0) - a) * per_row)
  assert buffer_rows(a, 2, 0.0) == 2 * a                          # dropless: G x a
  bounded = dataclasses.replace(run.compute, moe_capacity_factor=1.25)
  rows = dry_run.ep_buffer_bytes(cfg, bounded, e["mesh"], tokens, 2)
  assert rows == pytest.approx((math.ceil(1.25 * a) - a) * per_row)
  local = dict(e["mesh"], expert=1)
  assert dry_run.ep_buffer_bytes(cfg, run.compute, local, tokens, 2) == 0.0


@pytest.mark.slow
def test_libtpu_casts_a_scanned_weight_stack_once_outside_the_loop():
  """The fact behind scan_weight_copy: a layer scan whose body casts its fp32 weight slice to
  bf16 compiles (v5p, deviceless) to one convert of the whole stack in the entry
  computation, so a bf16 copy of every scanned weight is live through the step."""
  pytest.importorskip("libtpu", reason="needs libtpu (the TPU compiler) for a deviceless compile")
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from hybridmoe_jax.parallel import topology

  devices = topology.topology_devices("v5p-8")
  mesh = Mesh(devices, ("fsdp",))
  layers, experts, n, width = 4, 8, 512, 256

  def body(h, w):
    w = w.astype(jnp.bfloat16)
    g = jnp.einsum("tn,eni->ti", h, w)
    return jnp.tanh(jnp.einsum("ti,eni->tn", g, w)).astype(jnp.bfloat16), None

  def loss(ws, x):
    h, _ = jax.lax.scan(jax.checkpoint(body), x, ws)
    return jnp.sum(h.astype(jnp.float32))

  ws = jax.ShapeDtypeStruct((layers, experts, n, width), jnp.float32,
                            sharding=NamedSharding(mesh, P(None, None, "fsdp", None)))
  x = jax.ShapeDtypeStruct((1024, n), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
  entry = hlo[hlo.index("ENTRY"):]
  stack = f"bf16[{layers},{experts},{n // len(devices)},{width}]"
  assert any(stack in line and " convert(" in line for line in entry.splitlines())
