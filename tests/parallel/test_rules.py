"""Every parameter of every preset is placed by exactly one sharding decision."""

import dataclasses
import re

import jax
import pytest
from absl import logging
from flax import nnx
import optax

from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.parallel import rules
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.train import dry_run, optim
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.config.sharding import path_string, spec_for
from jax.sharding import PartitionSpec as P
from tests.conftest import ROOT, load_config
from tests.parallel.helpers import make_mesh

PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.py"))


def _abstract_params(name: str, scan_layers: bool = False):
  """The preset's parameters as shapes; flagships cut to their first four layers (one of
  each kind of layer: the rules match per layer, so depth adds no new path), or with
  `compute.scan_layers` to 13 (a prefix, 2 scanned repeats of the period and a tail)."""
  run = run_config_from_dict(load_config(name).to_dict())
  cfg = run.model
  keep = 13 if scan_layers else 4
  if cfg.num_layers > 8:
    cfg = dataclasses.replace(cfg, num_layers=keep, **(
        {"layer_kinds": cfg.layer_kinds[:keep]} if cfg.layer_kinds else {}))
  compute = dataclasses.replace(run.compute, scan_layers=scan_layers)
  model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute))
  return jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("name", PRESETS)
def test_every_parameter_has_exactly_one_rule(name, scan_layers):
  shard = [(re.compile(p), names) for p, names in rules.PARAM_LOGICAL]
  whole = [re.compile(p) for p in rules.REPLICATED]
  leaves = _abstract_params(name, scan_layers)
  assert leaves
  for path, leaf in leaves:
    p = path_string(path)
    hits = [names for r, names in shard if r.search(p)] + [None for r in whole if r.search(p)]
    assert len(hits) == 1, f"{name}: {p} matches {len(hits)} rules (want exactly one)"
    if hits[0] is not None:
      # A stacked leaf [R, ...] of the scanned layers: the rule names its layer's dims.
      stacked = p.startswith("stack/")
      assert len(hits[0]) + stacked == leaf.ndim, f"{name}: {p} rank {leaf.ndim} vs rule {hits[0]}"
      assert rules.logical_names(p, leaf.ndim) == ("layers",) * stacked + hits[0]


def test_low_rank_and_conv_weights_are_sharded():
  # These were replicated by a silent fallback before the rules named them.
  assert rules.logical_names("layers/3/mixer/q_a/kernel", 2) == ("embed", "latent")
  assert rules.logical_names("layers/3/mixer/q_b/kernel", 2) == ("latent_in", "heads")
  assert rules.logical_names("layers/0/mixer/g_proj/layers/1/kernel", 2) == ("latent_in", "heads")
  assert rules.logical_names("layers/0/mixer/k_conv/weight", 2) == ("conv", "heads")


def test_up_projections_and_the_vision_tower_split_over_fsdp():
  # Both were whole on every device (K3 on v5p-2048: libtpu's buffer assignment showed
  # q_b and the vision tower's weights and moments unsplit, ~12 GiB per device).
  mesh = {"data": 1, "fsdp": 8, "expert": 16, "tensor": 1, "context": 8}
  names = rules.logical_names("opt/mu/layers/3/mixer/q_b/kernel", 2)
  assert spec_for(names, (1536, 18432), mesh) == P(("fsdp", "context"))
  names = rules.logical_names("opt/mu/vision/blocks/4/up/kernel", 2)
  assert spec_for(names, (1024, 4096), mesh) == P(("fsdp", "context", "expert"))
  names = rules.logical_names("vision/proj_out/kernel", 2)
  assert spec_for(names, (7168, 7168), mesh) == P(None, ("fsdp", "context", "expert"))
  assert rules.logical_names("vision/blocks/0/attn_norm/scale", 1) == (None,)


def test_a_leaf_no_rule_names_is_logged_not_silent(monkeypatch):
  said = []
  monkeypatch.setattr(logging, "info", lambda msg, *a: said.append(msg % a))
  monkeypatch.setattr(rules, "_UNRULED_LOGGED", set())
  assert rules.logical_names("layers/0/mixer/new_proj/kernel", 2) == (None, None)
  assert rules.logical_names("layers/1/mixer/new_proj/kernel", 2) == (None, None)
  assert said == ["sharding: no rule names layers/0/mixer/new_proj/kernel (rank 2): replicated"]
  assert rules.logical_names("final_norm/scale", 1) == (None,) and len(said) == 1


@pytest.mark.parametrize("sizes", [dict(fsdp=2, expert=2, context=2), dict(fsdp=4, tensor=2)])
def test_per_device_state_bytes_equal_what_jax_places(sizes):
  """`estimate`'s per-device parameter and optimizer bytes are those of one device after the
  train state is placed by the sharding rules on a real (8-device, simulated) mesh."""
  config = load_config("tiny")
  config.mesh.update(data=1, fsdp=1, expert=1, tensor=1, context=1)
  config.mesh.update(**sizes)
  run = run_config_from_dict(config)
  e = dry_run.estimate(run, plan_lib.build_plan(run))
  mesh = make_mesh(**sizes)
  params = nnx.state(HybridLM(run.model, rngs=nnx.Rngs(0), compute=run.compute), nnx.Param)
  tx = optim.make_optimizer(run.train, optax.constant_schedule(1e-3))
  opt = tx.init(params)

  def one_device_bytes(tree):
    placed = jax.device_put(tree, rules.tree_shardings(tree, mesh))
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(placed))

  assert e["per_device_param_bytes"] == one_device_bytes(params)
  # The optimizer's scalar counters are counted once per parameter piece (a few bytes).
  assert e["per_device_opt_bytes"] == pytest.approx(one_device_bytes(opt), abs=64)
