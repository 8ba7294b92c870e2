"""The one run lifecycle of pre-training (`train/loop.py`) and RL (`rl/trainer.py`).

`open_run(...)` is a context manager that sets a run up in this order:
  1. --workdir made absolute, created and checked writable (InputError otherwise); SIGUSR1
     prints every thread's stack; a gs:// workdir is a local staging dir rebuilt from the
     bucket and pushed back at each checkpoint and at the end (`remote_workdir`);
  2. the workdir lock (process 0): one run per workdir, another live one -> InputError;
  3. the workdir's stored model config checked against this run's (ConfigError naming the
     fields), the run's tokenizer copied into workdir/tokenizer/ (process 0);
  4. the parallel runtime (mesh, execution plan: bad sizes stop here), then the variant's
     own input checks against it (`prepare(rt)`; pre-training builds its data there);
  5. the optimizer over the variant's LR schedule, the checkpointer, and the train state
     restored from the newest good checkpoint (`check` may set one aside) or initialised.
The body then does its own resume checks and calls `Run.begin`: the model config written to
the workdir, the model's size and kernels logged, the checkpoints' `meta` and the `Monitor`
(process i > 0 logs under process_<i>/). On leaving, whatever happened: the checkpointer
(waits for the last save), then the monitor close, then the lock is released.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Callable, Iterator

from absl import logging
import jax
import numpy as np

from hybridmoe_jax.cli import workdir_lock
from hybridmoe_jax.cli.errors import InputError, checked_workdir_path, make_writable_workdir
from hybridmoe_jax.cli.signals import dump_stacks_on_sigusr1
from hybridmoe_jax.config.run import RunConfig
from hybridmoe_jax.data import storage
from hybridmoe_jax.data.tokenizers.load import TOKENIZER_DIR
from hybridmoe_jax.data.tokenizers.load import save_tokenizer as copy_tokenizer
from hybridmoe_jax.model.impls import log_impls
from hybridmoe_jax.parallel import runtime as parallel_runtime
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import workdir_config
from hybridmoe_jax.train import optim, remote_workdir
from hybridmoe_jax.train.monitor import Monitor
from hybridmoe_jax.train.state import abstract_train_state, create_train_state


def save_tokenizer(tokenizer, directory: str) -> None:
  """Copy a file tokenizer into `directory`/tokenizer (InputError if another one is there);
  process 0 only."""
  if jax.process_index() != 0:
    return
  try:
    copy_tokenizer(tokenizer, os.path.join(directory, TOKENIZER_DIR))
  except ValueError as e:
    raise InputError(str(e)) from None


@dataclasses.dataclass
class Run:
  """What `open_run` built; `begin` adds `meta` and `monitor`."""

  config: RunConfig
  workdir: str                 # absolute
  model_dict: dict[str, Any]   # dataclasses.asdict(config.model): what checkpoints must match
  rt: parallel_runtime.Runtime
  inputs: Any                  # what `prepare(rt)` returned
  schedule: Any                # the LR schedule (a function of the applied updates)
  tx: Any                      # the optax optimizer over it
  ckpt: ckpt_lib.Checkpointer
  graphdef: Any
  state: Any                   # the TrainState, restored or initialised, on rt's shardings
  signature: str               # the state layout's signature (checkpoint meta)
  restored: ckpt_lib.Restored | None   # None: the run starts afresh
  meta: dict[str, Any] | None = None
  monitor: Monitor | None = None

  def begin(self, *, start_step: int = 0, total_steps: int = 0,
            tokens_seen: Callable[[int], int] = lambda step: 0) -> Monitor:
    """The run trains from here: workdir config written, sizes and kernels logged, the
    checkpoint meta and the monitor made."""
    workdir_config.write_workdir_config(self.workdir, self.model_dict)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state.params))
    n_bias = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state.biases))
    logging.info("model: %s parameters, %s routing-bias entries", f"{n_params:,}",
                 f"{n_bias:,}")
    log_impls(self.config.model, self.config.compute, plan=self.rt.plan)
    self.meta = {"model_config": self.model_dict, "signature": self.signature,
                 "config": json.dumps(dataclasses.asdict(self.config))}
    # Multi-process: only process 0 writes the run's logs; the others log under process_<i>/.
    logdir = self.workdir if jax.process_index() == 0 else os.path.join(
        self.workdir, f"process_{jax.process_index()}")
    os.makedirs(logdir, exist_ok=True)
    self.monitor = Monitor(logdir, self.config.train, start_step=start_step,
                           total_steps=total_steps, tokens_seen=tokens_seen)
    return self.monitor


@contextlib.contextmanager
def open_run(config: RunConfig, workdir: str, tokenizer, *, schedule, batch_size: int,
             grad_accum: int, seq_len: int, prepare: Callable[[Any], Any] = lambda rt: None,
             check: Callable[[int, ckpt_lib.Restored], None] | None = None) -> Iterator[Run]:
  """Set the run up in the module docstring's order; yield it; close it.

  Args:
    config, workdir, tokenizer: the run (the tokenizer already checked by the caller).
    schedule: the LR schedule the optimizer follows (optim.make_optimizer).
    batch_size, grad_accum, seq_len: the global batch the runtime checks against the mesh.
    prepare: prepare(rt) -> inputs, the variant's checks and inputs that need the runtime.
    check: passed to `Checkpointer.restore_latest` (raise to set a checkpoint aside).
  """
  t = config.train
  dump_stacks_on_sigusr1()
  workdir = checked_workdir_path(workdir)  # absolute: orbax wants absolute paths
  with contextlib.ExitStack() as closing:   # exits in reverse: checkpoints, monitor, lock
    staged = None
    if storage.is_remote(workdir):   # gs://: its lock, and a local staging dir synced to it
      staged = remote_workdir.open_staged(workdir, closing, stale_after_s=t.lock_stale_s)
      workdir = staged.local
    make_writable_workdir(workdir)
    if jax.process_index() == 0 and staged is None:
      # One run per workdir, taken before anything in it is read or moved: a second run must
      # not set aside the first one's save in progress as "partial".
      try:
        closing.enter_context(workdir_lock.WorkdirLock(workdir, stale_after_s=t.lock_stale_s))
      except workdir_lock.WorkdirBusy as e:
        raise InputError(str(e)) from None
    model_dict = dataclasses.asdict(config.model)
    workdir_config.check_workdir_config(workdir, model_dict, repair=True)
    save_tokenizer(tokenizer, workdir)  # the run is self-contained: evals read it there
    rt = parallel_runtime.setup(dataclasses.asdict(config.mesh), config.model, config.compute,
                                batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len)
    inputs = prepare(rt)
    tx = optim.make_optimizer(t, schedule)
    ckpt = ckpt_lib.Checkpointer(workdir, keep=t.keep_checkpoints,
                                 async_save=t.async_checkpoints,
                                 directory=t.checkpoint_dir or (
                                     staged and f"{staged.url}/checkpoints") or None)
    run = Run(config, workdir, model_dict, rt, inputs, schedule, tx, ckpt, None, None, "",
              None)
    if staged is not None:   # a committed step's logs are in the bucket: pushed before it
      ckpt.before_save.append(lambda step: (run.monitor is not None and run.monitor.flush(),
                                            staged.push_at_checkpoint(step)))
    closing.callback(lambda: run.monitor is not None and run.monitor.close())
    closing.callback(ckpt.close)   # waits for the last save
    _restore_or_init(run, check)
    yield run


def _restore_or_init(run: Run, check) -> None:
  """run.graphdef, state, signature and restored: the newest good checkpoint (on a mesh
  restored straight into this run's shardings: the saving mesh may differ), else a fresh
  state."""
  cfg, compute, seed = run.config.model, run.config.compute, run.config.train.seed
  run.graphdef, abstract = abstract_train_state(cfg, compute, run.tx, seed)
  run.signature = ckpt_lib.structure_signature(abstract)
  run.restored = run.ckpt.restore_latest(run.rt.restore_target(abstract), run.model_dict,
                                         check=check)
  if run.restored is not None:
    run.state = run.restored.state
    return
  if run.ckpt.skipped:
    logging.warning("no usable checkpoint in %s (%d set aside: %s): training starts again "
                    "at step 0", run.ckpt.directory, len(run.ckpt.skipped),
                    "; ".join(f"step {s}: {why}" for s, why in run.ckpt.skipped))
  run.state = run.rt.init_state(lambda: create_train_state(cfg, compute, run.tx, seed)[1],
                                abstract)
