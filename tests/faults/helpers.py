"""Shared pieces of the fault trials: the tiny in-process run, checkpoint fingerprints on
disk, metrics and log checks, and `run_train.py` subprocesses."""

from __future__ import annotations

import gc
import glob
import hashlib
import json
import logging as std_logging
import os
import subprocess
import sys
import time
import types

from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests.conftest import ROOT, SUBPROCESS_XLA_FLAGS, one_device
from tests._support import tiny_run_config
from tests.train.train_fakes import FakeIterator, train_losses  # noqa: F401

FAULT_CONFIG = ROOT / "tests" / "faults" / "fault_config.py"


def fake_data(config, iterator=None):
  t = config.train
  evals = list(FakeIterator(t.batch_size, t.seq_len, seed=99, length=2))
  return types.SimpleNamespace(train=iterator or FakeIterator(t.batch_size, t.seq_len),
                               eval_batches=evals)


# ------------------------------------------------------------------------------ checkpoints
def reference_run(workdir) -> dict:
  """The uninterrupted tiny run the trials compare with: workdir, config, summary, losses
  and every committed checkpoint's file hashes (a module fixture: one device forced, as
  module fixtures run before conftest's one-device fixture)."""
  config = tiny_run_config(trial=True)
  with one_device():
    summary = train_and_evaluate(run_config_from_dict(config), str(workdir), data=fake_data(config))
  return dict(workdir=workdir, config=config, summary=summary, losses=train_losses(workdir),
              hashes=all_hashes(workdir))


def committed_steps(workdir) -> list[int]:
  """Steps under workdir/checkpoints whose save finished (orbax renamed the tmp dir)."""
  d = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(d):
    return []
  return sorted(int(n) for n in os.listdir(d) if n.isdigit())


def step_hashes(workdir, step: int) -> dict[str, str]:
  """{relative path: sha256} of every file of checkpoint `step`."""
  root = os.path.join(workdir, "checkpoints", str(step))
  out = {}
  for f in sorted(glob.glob(os.path.join(root, "**"), recursive=True)):
    if os.path.isfile(f):
      with open(f, "rb") as fh:
        out[os.path.relpath(f, root)] = hashlib.sha256(fh.read()).hexdigest()
  return out


def all_hashes(workdir) -> dict[int, dict[str, str]]:
  return {s: step_hashes(workdir, s) for s in committed_steps(workdir)}


def assert_kept(workdir, before: dict[int, dict[str, str]]) -> None:
  """Every checkpoint recorded in `before` is still in checkpoints/, byte-identical."""
  for step, files in before.items():
    assert step_hashes(workdir, step) == files, f"checkpoint {step} changed or vanished"


class LogLines(std_logging.Handler):
  """Collects every log record at WARNING and above (absl's and other libraries', e.g.
  asyncio's), on the root logger."""

  def __init__(self):
    super().__init__(std_logging.WARNING)
    self.records = []

  def emit(self, record):
    self.records.append(record)

  def messages(self) -> list[str]:
    return [r.getMessage() for r in self.records]

  def __enter__(self):
    std_logging.getLogger().addHandler(self)
    return self

  def __exit__(self, *exc):
    std_logging.getLogger().removeHandler(self)


class Unraisable:
  """Collects exceptions raised where nobody can catch them (finalisers, callbacks into a
  closed event loop) while inside; at the end it lets late callbacks arrive (a second) and
  collects the garbage. Whatever hooks the code under test adds on top (its filters) see
  them first."""

  def __init__(self):
    self.seen: list[str] = []

  def _hook(self, u):
    self.seen.append(f"{u.exc_type.__name__}: {u.exc_value} ({u.err_msg})")

  def __enter__(self):
    self._old, sys.unraisablehook = sys.unraisablehook, self._hook
    return self

  def __exit__(self, *exc):
    time.sleep(1.0)
    gc.collect()
    sys.unraisablehook = self._old


# ------------------------------------------------------------------------------ subprocesses
def subprocess_env(cache_dir=None) -> dict[str, str]:
  """The repo on PYTHONPATH (this worktree's code), one CPU device, and a persistent compile
  cache shared by a trial's runs (a resume then skips the ~20 s compile; same executables,
  so the numbers stay bitwise equal)."""
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": SUBPROCESS_XLA_FLAGS}
  if cache_dir:
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


def train_cmd(workdir, *overrides: str) -> list[str]:
  return [sys.executable, str(ROOT / "run_train.py"), f"--config={FAULT_CONFIG}",
          f"--workdir={workdir}", *overrides]


def start_train(workdir, *overrides: str, cache_dir=None, log=None) -> subprocess.Popen:
  return subprocess.Popen(train_cmd(workdir, *overrides), cwd=ROOT, env=subprocess_env(cache_dir),
                          stdout=subprocess.PIPE if log is None else log,
                          stderr=subprocess.STDOUT, text=True)


def run_train(workdir, *overrides: str, cache_dir=None, timeout=600):
  """-> CompletedProcess (stdout and stderr together in .stdout)."""
  return subprocess.run(train_cmd(workdir, *overrides), cwd=ROOT, env=subprocess_env(cache_dir),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        timeout=timeout, check=False)


INJECT = ROOT / "tests" / "faults" / "inject.py"


def injected_cmd(fault: str, *cmd: str) -> list[str]:
  """`cmd` (a script path and its args, or "-m", module, args) run under tests/faults/inject.py
  with `fault` injected at the OS-call level."""
  return [sys.executable, str(INJECT), fault, *cmd]


def run_cli(cmd: list[str], *, cache_dir=None, timeout=600, fault: str | None = None):
  """Any CLI of the repo (`[script or -m module, args...]`), optionally with a fault
  injected -> CompletedProcess (stdout and stderr together in .stdout)."""
  full = injected_cmd(fault, *cmd) if fault else [sys.executable, *cmd]
  return subprocess.run(full, cwd=ROOT, env=subprocess_env(cache_dir), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False)


def train_args(workdir, *overrides: str) -> list[str]:
  """run_train.py's argv (without the interpreter) for the fault config."""
  return train_cmd(workdir, *overrides)[1:]


def error_lines(output: str) -> list[str]:
  """The user-facing `error: ...` lines of a run's output."""
  return [l for l in output.splitlines() if l.startswith("error:")]


def metrics_events(workdir) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]
