"""The dry run: a config's parameter counts and per-device memory per stage against its target
`hardware` (`train/dry_run.py`), without allocating the model; with a TPU topology or GPU node
(`--config.hardware.topology=v5p-256`, 'h100:8') also the AOT compile of its steps for it
(`tools/aot.py`: libtpu / the CUDA plugin, no accelerator needed).

  python -m hybridmoe_jax.tools.footprint --config=configs/kimi_k3.py
  python -m hybridmoe_jax.tools.footprint --config.hardware.topology=v5p:2x2x1

`run_train.py --dry_run` is the same program (it imports this module's --aot_* flags).
Exit status: 0, or 1 with one `error:` line (a bad config or override).
"""

import os
import sys

from absl import app
from absl import flags

from hybridmoe_jax.config.run import RunConfig

_AOT_LAYERS = flags.DEFINE_string(
    "aot_layers", "", "--dry_run on a topology: compile the model at A and B layers ('A,B') "
    "and extrapolate linearly per layer to its depth (a flagship at full depth takes long).")
_AOT_STAGES = flags.DEFINE_string(
    "aot_stages", "", "--dry_run on a topology: compile only these stages' train steps "
    "(indices or names, e.g. '0,1m'; default every stage).")
_AOT_SERVE = flags.DEFINE_bool(
    "aot_serve", True, "--dry_run on a topology: also compile a prefill chunk and a decode "
    "step.")
_AOT_COST = flags.DEFINE_bool(
    "aot_cost", True, "--dry_run on a topology: also compile the unrolled loops that cost "
    "the step time and MFU (--noaot_cost: memory only, one compile per train step).")


def report(run: RunConfig) -> None:
  """Print the dry run of `run`, and its AOT report when `run.hardware.topology` is set."""
  # pylint: disable=g-import-not-at-top
  if run.hardware.topology and not os.environ.get("JAX_PLATFORMS"):
    import jax  # compile for TPU devices that libtpu describes, on this host's CPU
    jax.config.update("jax_platforms", "cpu")
  from hybridmoe_jax.train import dry_run
  dry_run.dry_run(run)
  if run.hardware.topology:
    from hybridmoe_jax.tools import aot, aot_table
    aot_table.aot_report(run, layers=aot.parse_layers(_AOT_LAYERS.value), stages=_AOT_STAGES.value,
                   serve=_AOT_SERVE.value, cost=_AOT_COST.value)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.cli import terminal
  terminal.skip_absent_tpu()  # before any backend starts: no libtpu probe on a CPU machine
  terminal.install(bar=False)
  from hybridmoe_jax.config import ConfigError
  from hybridmoe_jax.config.run import run_config_from_dict
  try:
    report(run_config_from_dict(flags.FLAGS.config))
  except (ConfigError, OSError) as e:  # OSError: the --config file could not be loaded
    sys.exit(f"error: {' '.join(str(e).split())}")


if __name__ == "__main__":
  from hybridmoe_jax.config import flags as cli_flags  # pylint: disable=g-import-not-at-top
  _REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cli_flags.define_config_flag(os.path.join(_REPO, "configs", "tiny.py"), "Run config file "
                               "(a configs/*.py preset; default configs/tiny.py); set any "
                               "field with --config.<section>.<field>=value.")
  flags.declare_key_flag("config")
  app.run(main, flags_parser=cli_flags.parse_flags)
