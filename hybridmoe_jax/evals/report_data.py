"""Everything the run report shows, read from a workdir without changing anything in it.

Sources (all optional, each failure becomes a note): `metrics.jsonl` (train / eval records,
start and resume events with the hardware, alerts; an unparsable line, e.g. the half-written
last line of a run still training, is skipped with a note), `model_config.json` (parameter
counts via `model.count`, no weights loaded), the newest checkpoint's meta (the run config,
through the read-only `Checkpointer`), the step directories of `checkpoints/` and
`checkpoints_corrupt/`, and the eval results `run_eval.py` wrote to `eval/<task>.json`
(`eval/agent.json` included).

An RL run (rl/trainer.py) logs {"event": "sft" | "rl" | "eval", "step", ...} records instead
of pre-training's {"split": ...}; `plots.history.split_records(field="event")` reads them
and `RunData.is_rl` tells.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from hybridmoe_jax.config import model_config_from_dict
from hybridmoe_jax.evals.runner import TASKS
from hybridmoe_jax.model import count
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import workdir_config

METRICS_FILE = "metrics.jsonl"
# eval/<name>.json files a report shows: run_eval's tasks and --task=agent (its "results")
EVAL_FILES = TASKS + ("agent",)
RL_EVENTS = ("sft", "rl")


@dataclasses.dataclass
class RunData:
  """What a report shows; `notes` says what was missing, skipped or unreadable."""

  workdir: str
  records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  metrics_mtime: float | None = None
  model_config: dict[str, Any] | None = None
  params: dict[str, Any] | None = None          # total, active, per component
  run_config: dict[str, Any] | None = None      # the checkpoint's RunConfig as a dict
  checkpoints: list[tuple[int, float]] = dataclasses.field(default_factory=list)
  partial_checkpoints: list[str] = dataclasses.field(default_factory=list)
  corrupt: list[str] = dataclasses.field(default_factory=list)
  evals: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  notes: list[str] = dataclasses.field(default_factory=list)

  @property
  def is_rl(self) -> bool:
    """An RL run: it logged SFT steps or RL iterations, or its config names RL envs."""
    return (any(r.get("event") in RL_EVENTS for r in self.records)
            or bool(((self.run_config or {}).get("rl") or {}).get("envs")))


def read_metrics(path: str, notes: list[str]) -> list[dict[str, Any]]:
  """JSON records of `path`, one per line; bad lines are skipped with a note each."""
  records = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for i, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        r = json.loads(line)
      except (ValueError, RecursionError) as e:  # also an integer of over 4300 digits
        notes.append(f"{METRICS_FILE} line {i} is not valid JSON "
                     f"({getattr(e, 'msg', str(e)[:80])}; a truncated write?): skipped")
        continue
      if isinstance(r, dict):
        records.append(r)
      else:
        notes.append(f"{METRICS_FILE} line {i} is not a JSON object: skipped")
  return records


def _param_counts(model_dict: dict[str, Any]) -> dict[str, Any]:
  cfg = model_config_from_dict(model_dict)
  parts = count.param_breakdown(cfg)
  out = {"total": sum(parts.values()), "active": count.active_from_breakdown(cfg, parts),
         "components": parts}
  if cfg.vision.enabled:
    out["vision"] = count.vision_breakdown(cfg)
  return out


def _list_checkpoints(run: RunData) -> None:
  ckdir = os.path.join(run.workdir, "checkpoints")
  if os.path.isdir(ckdir):
    for name in sorted(os.listdir(ckdir)):
      full = os.path.join(ckdir, name)
      if name.isdigit() and os.path.isdir(full):
        run.checkpoints.append((int(name), os.path.getmtime(full)))
      elif os.path.isdir(full):
        run.partial_checkpoints.append(name)   # e.g. an orbax tmp dir of a save in flight
    run.checkpoints.sort()
  bad = os.path.join(run.workdir, "checkpoints_corrupt")
  if os.path.isdir(bad):
    run.corrupt = sorted(os.listdir(bad))


def _read_run_config(run: RunData) -> None:
  """The run config stored in the newest checkpoint's meta (read-only, no weights)."""
  if not run.checkpoints:
    return
  try:
    ckpt = ckpt_lib.Checkpointer(run.workdir, read_only=True)
    step = ckpt.latest_step()
    if step is not None:
      run.run_config = json.loads(ckpt.read_meta(step)["config"])
  except Exception as e:  # pylint: disable=broad-except
    run.notes.append(f"run config: newest checkpoint's metadata unreadable "
                     f"({type(e).__name__}: {str(e)[:200]})")


def _read_evals(run: RunData) -> None:
  folder = os.path.join(run.workdir, "eval")
  for task in EVAL_FILES:
    path = os.path.join(folder, f"{task}.json")
    if not os.path.isfile(path):
      continue
    try:
      with open(path, encoding="utf-8") as f:
        saved = json.load(f)
      result = saved["results"] if task == "agent" else saved["result"]
      model = saved.get("model", {})
      if not isinstance(result, dict) or not isinstance(model, dict):
        raise TypeError("not a JSON object")
      run.evals[task] = {"result": result, "model": model, "mtime": os.path.getmtime(path)}
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
      run.notes.append(f"eval/{task}.json unreadable ({type(e).__name__}): skipped")


def read_run(workdir: str) -> RunData:
  """Everything in `workdir` a report shows (read-only).

  Raises:
    ValueError: `workdir` does not exist, or holds neither metrics.jsonl nor
      model_config.json (not a training run).
  """
  if not os.path.isdir(workdir):
    raise ValueError(f"--workdir {workdir} does not exist")
  metrics = os.path.join(workdir, METRICS_FILE)
  config_file = os.path.join(workdir, workdir_config.CONFIG_FILE)
  if not os.path.isfile(metrics) and not os.path.isfile(config_file):
    raise ValueError(f"--workdir {workdir} holds no training run (no {METRICS_FILE} and no "
                     f"{workdir_config.CONFIG_FILE})")
  run = RunData(workdir=os.path.abspath(workdir))
  if os.path.isfile(metrics):
    run.records = read_metrics(metrics, run.notes)
    run.metrics_mtime = os.path.getmtime(metrics)
  else:
    run.notes.append(f"no {METRICS_FILE}: no curves, throughput, alerts or expert load")
  try:
    run.model_config = workdir_config.read_model_config(workdir)
    if run.model_config is None:
      run.notes.append(f"no {workdir_config.CONFIG_FILE}: no model config or parameter counts")
    else:
      run.params = _param_counts(run.model_config)
  except (OSError, ValueError, TypeError) as e:    # ConfigError is a ValueError
    run.notes.append(f"{workdir_config.CONFIG_FILE} unreadable ({type(e).__name__}: "
                     f"{str(e)[:200]})")
  _list_checkpoints(run)
  _read_run_config(run)
  _read_evals(run)
  return run


def age(seconds_since_epoch: float | None) -> str:
  """"3m12s ago" for a file time; "?" when unknown."""
  if seconds_since_epoch is None:
    return "?"
  s = max(0, int(time.time() - seconds_since_epoch))
  h, rem = divmod(s, 3600)
  m, s = divmod(rem, 60)
  return (f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s") + " ago"
