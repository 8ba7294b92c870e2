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
