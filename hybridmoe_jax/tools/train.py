"""run_train.py's program after its flags: start the processes, resolve the config, then the
dry run (`tools/footprint.py`), an RL run (`rl/trainer.py`) or pre-training (`train/loop.py`),
and after pre-training a sample, where the outputs are and the next commands.

Errors a user can act on end the process with one `error:` line (exit 1); a run stopped by
signal N after a clean checkpoint exits 128 + N. The imports wait inside `main` because the
terminal setup and `jax.distributed` must come before anything starts a jax backend.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from absl import logging

SAMPLE_DEFAULT = 200   # --sample_tokens when stdout is a terminal


def main(config_flag, *, config_file: str, overrides: list[str], workdir: str,
         print_config: bool, init_from: str | None, dry_run: bool,
         export_params_to: str | None, sample_tokens: int | None, sample_prompt: str,
         absl_logs: bool, distributed: dict[str, Any]) -> None:
  """Run run_train.py's program with its flag values.

  Args:
    config_flag: the --config flag holder (its `.value` loads the file lazily: read here,
      after the distributed start).
    config_file, overrides: the --config file name and the --config.* arguments, for
      --print_config.
    distributed: `parallel.distributed.initialize`'s keyword arguments.
  """
  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.cli import terminal
  terminal.skip_absent_tpu()  # before any backend starts: no libtpu probe on a CPU machine
  if not absl_logs:
    terminal.install()
  from hybridmoe_jax.config import ConfigError
  from hybridmoe_jax.parallel import distributed as distributed_lib
  try:  # before anything touches a jax backend
    distributed_lib.initialize(**distributed)
  except ValueError as e:
    sys.exit(f"error: {e}")
  from hybridmoe_jax.config import flags as cli_flags
  from hybridmoe_jax.config.run import run_config_from_dict
  from hybridmoe_jax.cli import errors, io_noise
  from hybridmoe_jax.train import checkpoint, loop
  from hybridmoe_jax.tools import footprint
  try:
    config = config_flag.value
    config.keys()  # a lazy proxy: raises here if the file failed to load
  except OSError as e:  # the --config file could not be loaded
    sys.exit(f"error: {' '.join(str(e).split())}")
  if print_config:
    print(cli_flags.config_yaml(config, config_file, overrides), end="")
    return
  try:
    if init_from:
      config.rl.init_from = init_from
    run = run_config_from_dict(config)  # the typed config everything below takes
    if init_from and not run.rl.enabled:
      raise ConfigError("--init_from is for RL runs (a config with rl.envs), e.g. "
                        "--config=configs/rl_tiny.py")
    if export_params_to and run.rl.enabled:  # the RL trainer writes no export: say so now
      raise ConfigError(f"--export_params_to={export_params_to} is for pre-training runs; an "
                        "RL run (a config with rl.envs) keeps its checkpoints in --workdir, "
                        "which run_eval.py --workdir and hybridmoe_jax.load read")
    if dry_run:
      footprint.report(run)
      return
    logging.info("config %s, workdir %s", config_file, workdir)
    if run.rl.enabled:
      from hybridmoe_jax.rl import trainer as rl_trainer
      summary = rl_trainer.train_rl(run, workdir)
    else:
      on_stage_end = None
      if run.curriculum.enabled and run.curriculum.niah_lengths:
        from hybridmoe_jax.evals.stage_niah import StageNiah
        on_stage_end = StageNiah.from_run(run, workdir)
      summary = loop.train_and_evaluate(run, workdir, export_params_to=export_params_to,
                                        on_stage_end=on_stage_end)
  except (ConfigError, errors.InputError, errors.TrainingDiverged,
          checkpoint.NonFiniteState, checkpoint.CheckpointWriteError,
          errors.OutOfMemory) as e:
    sys.exit(f"error: {e}")
  except OSError as e:  # a full disk hit a log write (metrics, TensorBoard) before a save did
    if e.errno not in io_noise.FULL_ERRNOS:
      raise
    what, fix = io_noise.describe_write_error(e)
    sys.exit(f"error: cannot write {e.filename or workdir}: {what}; the "
             f"checkpoints in {workdir} are intact. {fix[0].upper() + fix[1:]}, then "
             "rerun to resume")
  if summary["stopped_by"]:  # a clean stop, checkpoint saved: the shell's 128 + signal code
    sys.exit(128 + signal.Signals[summary["stopped_by"]].value)
  if not run.rl.enabled and not summary.get("already_finished"):
    _print_end(summary, workdir, sample_tokens, sample_prompt)


def _print_end(summary, workdir: str, n: int | None, prompt: str) -> None:
  """After pre-training: a sample of the model (n tokens; None: SAMPLE_DEFAULT on a
  terminal, else none), where the outputs are, what to run next."""
  # pylint: disable=g-import-not-at-top
  import jax
  from hybridmoe_jax.cli.terminal import end_lines
  if jax.process_index() != 0:
    return
  n = (SAMPLE_DEFAULT if sys.stdout.isatty() else 0) if n is None else n
  if n and jax.process_count() == 1:   # api.load reads the run into one process's devices
    from hybridmoe_jax import api
    try:
      room = len(prompt.encode()) + n + 8   # BOS, slack
      lm = api.load(workdir, max_len=room)
      text = lm.generate(prompt, max_new_tokens=n, temperature=0.8, seed=0)
      print(f"\nsample ({n} tokens, temperature 0.8):\n"
            f"{prompt}{text}\n{'-' * 40}")
    except (ValueError, OSError) as e:  # e.g. a prompt the tokenizer cannot encode
      print(f"(no sample: {e})")
    sys.stdout.flush()
  print("\n".join(end_lines(summary, workdir)))
