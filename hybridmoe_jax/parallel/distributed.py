"""Multi-process start-up: `jax.distributed.initialize` from flags (call before any jax work).

Three ways to start, chosen by `initialize(...)` arguments (run_train.py flags):
  - nothing set and `enable=False`: single process (no call at all);
  - `enable=True` without an address: JAX auto-detects the cluster (Cloud TPU pods,
    SLURM / Open MPI / Kubernetes GPU clusters) and each process finds its id;
  - explicit coordinator address, number of processes and process id (any cluster, or
    several local processes for a CPU demo).
On CPU, cross-process collectives need the gloo implementation; it is selected here.
After this, `jax.devices()` lists every process's devices (the mesh spans all of them), each
process loads its own 1 / process_count of every batch, and checkpoints are written and read
collectively.
"""

from __future__ import annotations

from absl import logging
import jax


def initialize(*, enable: bool = False, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               cpu_collectives: str = "gloo") -> bool:
  """Start the multi-process runtime if asked to; returns True when it was started.

  Raises:
    ValueError: an explicit start with a missing or inconsistent field (named).
  """
  explicit = coordinator_address is not None
  if not (enable or explicit):
    if num_processes not in (None, 1) or process_id not in (None, 0):
      raise ValueError("--num_processes/--process_id need --coordinator_address (or "
                       "--distributed for cluster auto-detection)")
    return False
  if explicit:
    if num_processes is None or num_processes < 1:
      raise ValueError(f"--num_processes={num_processes} is invalid: allowed an integer >= 1 "
                       "with --coordinator_address")
    if process_id is None or not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id} is invalid: allowed [0, {num_processes})")
  # Selecting the CPU collectives must happen before the CPU backend exists.
  if cpu_collectives:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  kwargs = {}
  if explicit:
    kwargs = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                  process_id=process_id)
  jax.distributed.initialize(**kwargs)
  logging.info("distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


_PER_PROCESS = "per_process"


def gather_host_states(state: dict) -> dict:
  """Every process's (JSON-able) data-iterator state, for the primary process to save.

  Single process: `state` unchanged. Several: {"per_process": [state_0, state_1, ...]}
  (JSON strings padded to one length and all-gathered as uint8; every process calls this).
  """
  if jax.process_count() == 1:
    return state
  import json  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  raw = np.frombuffer(json.dumps(state).encode(), np.uint8)
  size = int(np.max(multihost_utils.process_allgather(np.asarray([raw.size], np.int32))))
  buf = np.zeros((size,), np.uint8)
  buf[:raw.size] = raw
  rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), size)
  return {_PER_PROCESS: [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]}


def own_host_state(saved: dict) -> dict:
  """This process's entry of a `gather_host_states` result (a plain state passes through).

  Raises:
    ConfigError: the checkpoint was written by a different number of processes (each
      process's grain shard and position would not match).
  """
  from hybridmoe_jax.config import ConfigError  # pylint: disable=g-import-not-at-top
  if _PER_PROCESS not in saved:
    if jax.process_count() > 1 and saved:
      raise ConfigError("the checkpoint's data state was written by 1 process; resuming it "
                       f"with {jax.process_count()} processes would repeat data")
    return saved
  states = saved[_PER_PROCESS]
  if len(states) != jax.process_count():
    raise ConfigError(f"the checkpoint's data state was written by {len(states)} processes; "
                     f"this run has {jax.process_count()}: resume with the same count")
  return states[jax.process_index()]
