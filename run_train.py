"""Train a hybrid KDA/MLA MoE language model.

  python run_train.py                                   # tiny config, bundled text, ~minutes
  python run_train.py --config=configs/tiny.py --config.train.steps=300 --workdir=runs/x
  python run_train.py --config=configs/kimi_k3.py --dry_run   # counts + memory, no allocation
  python run_train.py --dry_run --config.hardware.topology=v5p:2x2x1  # + TPU AOT compile
  python run_train.py --config.mesh.data=2 --config.mesh.fsdp=1 --config.mesh.expert=4  # 8 devices
  python run_train.py --coordinator_address=host0:1234 --num_processes=2 --process_id=0 ...
  python run_train.py --config=configs/rl_tiny.py --workdir=runs/rl    # agentic RL (SFT + GRPO)
  python run_train.py --config=configs/rl_tiny.py --init_from=runs/x --workdir=runs/rl2
  python run_train.py --print_config                    # every config field, then exit
  python run_train.py --workdir=runs/default --export_params_to=runs/params  # a finished run

The run resumes from the newest good checkpoint in --workdir; rerunning a finished run
trains and logs nothing (it says so; with --export_params_to it writes the export). A config
whose `rl.envs` is set is an RL run (`hybridmoe_jax.rl.trainer`), else pre-training
(`hybridmoe_jax.train`); this file only parses flags (the program after them is
`hybridmoe_jax.tools.train.main`). Progress: clean lines (a bar on a terminal) ending in one
`done:` summary line, then a sample, where the outputs are and the next commands
(--absl_logs: absl's lines).

Exit status: 0 finished; 1 an error, told in one line (bad config or data, a workdir in use
by another run, training diverged, a checkpoint that cannot be written: disk full); 128 + N
stopped by signal N (130 SIGINT, 143 SIGTERM) after a clean checkpoint: rerun to resume.
"""

import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from hybridmoe_jax.config import flags as cli_flags
from hybridmoe_jax.tools import footprint  # the dry run's program and its --aot_* flags
from hybridmoe_jax.tools import train

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny.py")


_CONFIG = cli_flags.define_config_flag(
    _DEFAULT_CONFIG, "Run config file (a configs/*.py preset; default configs/tiny.py). Set "
    "any field with --config.<section>.<field>=value, e.g. --config.train.steps=50; "
    "--print_config lists every field.")
flags.declare_key_flag("config")   # defined in cli_flags: shown by --help all the same
flags.adopt_module_key_flags(footprint)   # --aot_*: shown by --help too
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False,
                                  "Print the resolved config (after overrides) and exit.")
_SAMPLE_TOKENS = flags.DEFINE_integer(
    "sample_tokens", None, "Pre-training: tokens of a sample generated after training "
    f"(temperature 0.8); 0 for none. Default {train.SAMPLE_DEFAULT} when stdout is a terminal, "
    "else none (scripts and CI skip its ~20 s of compilation).", lower_bound=0)
_SAMPLE_PROMPT = flags.DEFINE_string("sample_prompt", "The ", "The sample's prompt.")
_ABSL_LOGS = flags.DEFINE_bool(
    "absl_logs", False, "absl's log lines (level, time, thread, file:line) instead of clean "
    "ones, and no progress bar.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default",
                               "Checkpoints, TensorBoard events, metrics and heatmaps.")
_EXPORT = flags.DEFINE_string(
    "export_params_to", None, "Write a params-only checkpoint (with routing biases) at the end.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "RL runs: start from this training workdir or params export (sets "
    "config.rl.init_from; the SFT warm start is skipped).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False,
                             "Print parameter counts and per-device memory, then exit. With "
                             "--config.hardware.topology=v5p-256 (any TPU topology), also "
                             "compile the steps for it (libtpu, no TPU needed; --aot_* flags: "
                             "`hybridmoe_jax.tools.footprint`, the same program).")
# Multi-process (multi-host) runs: see hybridmoe_jax/parallel/distributed.py.
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Start jax.distributed; without --coordinator_address the cluster "
    "(TPU pod, SLURM, Open MPI, Kubernetes) is auto-detected.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (explicit multi-process start).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id in [0, num_processes).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  train.main(_CONFIG, config_file=config_flags.get_config_filename(flags.FLAGS["config"]),
             overrides=[a for a in sys.argv[1:] if a.startswith("--config.")],
             workdir=_WORKDIR.value, print_config=_PRINT_CONFIG.value,
             init_from=_INIT_FROM.value, dry_run=_DRY_RUN.value,
             export_params_to=_EXPORT.value, sample_tokens=_SAMPLE_TOKENS.value,
             sample_prompt=_SAMPLE_PROMPT.value, absl_logs=_ABSL_LOGS.value,
             distributed={"enable": _DISTRIBUTED.value,
                          "coordinator_address": _COORDINATOR.value,
                          "num_processes": _NUM_PROCESSES.value,
                          "process_id": _PROCESS_ID.value})


if __name__ == "__main__":
  app.run(main, flags_parser=cli_flags.parse_flags)
