"""The dry run's advice when a stage does not fit: more devices when the model state alone
is over (grad_accum and mesh.context shrink only activations), grad_accum / context else."""

import math

from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.train import dry_run
from tests.conftest import load_config


def test_state_advice_names_the_slice_that_holds_the_state():
  gib = 2 ** 30
  line = dry_run.state_advice(735.45 * gib, 57.6 * gib, 1)
  assert "at least 13 devices" in line and "a slice of 16" in line
  assert "grad_accum and mesh.context do not shrink it" in line
  # Per device on a mesh of 4: the state of all 4 counts.
  assert "at least 52 devices" in dry_run.state_advice(735.45 * gib, 57.6 * gib, 4)
  assert math.ceil(735.45 * 4 / 57.6) == 52


def test_one_device_flagship_is_told_to_shard_not_to_accumulate(capsys):
  """Kimi-Linear-48B on one 64 GiB device: the optimizer state alone is hundreds of GiB;
  the verdict asks for a slice, never for grad_accum or mesh.context."""
  config = load_config("kimi_linear_48b")
  config.mesh.update(data=1, fsdp=1, expert=1, tensor=1, context=1)
  e = dry_run.dry_run(run_config_from_dict(config))
  verdicts = [l for l in capsys.readouterr().out.splitlines() if "does not fit" in l]
  assert e["fits"] and not any(e["fits"]) and verdicts
  for line in verdicts:
    assert "shard it over at least" in line and "a slice of" in line
    assert "raise train.grad_accum" not in line


def test_the_expert_gather_choice_is_printed(capsys):
  """Issue 44: the dry run says how often a step gathers the routed experts' weights (ZeRO-3
  gathers them in every microbatch) and whether one gather per step (grad_accum 1) fits."""
  def line(**mesh_and_accum):
    config = load_config("tiny")
    ga = mesh_and_accum.pop("grad_accum")
    config.mesh.update(data=1, tensor=1, context=1, **mesh_and_accum)
    config.train.update(batch_size=8, grad_accum=ga)
    dry_run.dry_run(run_config_from_dict(config))
    return [l for l in capsys.readouterr().out.splitlines() if "expert weights:" in l]
  assert "never gathered" in line(fsdp=1, expert=1, grad_accum=2)[0]
  assert "gathered once per step" in line(fsdp=4, expert=2, grad_accum=1)[0]
  (per_mb,) = line(fsdp=4, expert=2, grad_accum=4)
  assert "each of the 4 microbatches" in per_mb and "train.grad_accum = 1" in per_mb
  assert "fits (" in per_mb     # tiny: one microbatch of 8 rows fits any device
  config = load_config("tiny")
  config.model.moe.first_dense_layers = config.model.num_layers   # no routed experts
  config.mesh.update(data=1, fsdp=4, expert=1, tensor=1, context=1)
  dry_run.dry_run(run_config_from_dict(config))
  assert "expert weights:" not in capsys.readouterr().out
