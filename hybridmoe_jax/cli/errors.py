"""The errors that stop a training run with one line (the CLIs print them, no traceback),
and the `--workdir` checks that raise them before anything is built."""

from __future__ import annotations

import os

from hybridmoe_jax.config.run import RunConfig


class InputError(ValueError):
  """Bad training input (data path, dataset, token ids, batch shapes): stops the run."""


class OutOfMemory(RuntimeError):
  """The device (or host) ran out of memory for a train step: one line naming the knobs."""


def is_out_of_memory(e: BaseException) -> bool:
  text = str(e)
  return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or \
      "Out of memory" in text or "out of memory" in text


def oom_message(e: BaseException, run: RunConfig) -> str:
  t, c = run.train, run.compute
  first = next((l.strip() for l in str(e).splitlines() if l.strip()), type(e).__name__)
  return (f"out of memory in the train step ({first[:160]}); lower train.batch_size "
          f"(now {t.batch_size}) or train.seq_len (now {t.seq_len}), set compute.remat="
          f"'full' (now {c.remat!r}), or raise train.grad_accum (microbatches per step, now "
          f"{t.grad_accum}; it must divide batch_size); `run_train.py --dry_run` estimates "
          "the memory per device")


class TrainingDiverged(RuntimeError):
  """`train.max_consecutive_skips` updates in a row were non-finite: the run stopped and
  saved nothing after the last good checkpoint."""


def checked_workdir_path(workdir: str | None) -> str:
  """`workdir` made absolute (a gs:// URL without its trailing /); InputError for an empty
  one (`--workdir=` would train into the current directory) or a bucket without a path."""
  if not workdir or not str(workdir).strip():
    raise InputError(f"--workdir={workdir or ''!s} is empty: give the directory for the "
                     "run's checkpoints and logs, e.g. --workdir=runs/x")
  if "://" in str(workdir):
    scheme, _, rest = str(workdir).rstrip("/").partition("://")
    if scheme != "gs" or "/" not in rest:
      raise InputError(f"--workdir={workdir}: a cloud workdir is gs://<bucket>/<path> (a "
                       "directory inside a bucket)")
    return f"gs://{rest}"
  return os.path.abspath(workdir)


def make_writable_workdir(workdir: str) -> None:
  """Create `workdir` if needed; InputError naming it if it cannot be created or written
  (also when it is a regular file)."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise InputError(f"--workdir={workdir} is a file, not a directory; choose another "
                     "--workdir")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise InputError(f"cannot create --workdir={workdir}: {e.strerror or e}") from None
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise InputError(f"--workdir={workdir} is not writable (checkpoints, logs and the run "
                     "lock go there); fix its permissions or choose another --workdir")
