"""The model config a workdir holds (`workdir/model_config.json`) and the checks against it.

Every field of the architecture (`ModelConfig`) must match between a run and the workdir it
resumes, a checkpoint's meta, an `rl.init_from` source or a params export; runtime settings
(`ComputeConfig`) are outside it. Stored configs go through the legacy migration first, so
one written by older code compares equal to the same architecture written today.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from absl import logging

from hybridmoe_jax.config import ConfigError, migrate_legacy, model_config_from_dict

CONFIG_FILE = "model_config.json"


def jsonify(d):
  """`d` as it reads back from a JSON file (tuples become lists)."""
  return json.loads(json.dumps(d, default=list))


def legacy_model_dict(d: dict[str, Any]) -> dict[str, Any]:
  """A stored model config (JSON dict) in today's layout: without the fields older code kept
  there that are runtime settings now, and with fields added since it was written at their
  defaults (a run saved before `vision` existed had no vision tower)."""
  migrated = migrate_legacy({"model": jsonify(d)})["model"]
  # The typed round trip is the one checker: it fills absent fields with their defaults.
  return jsonify(dataclasses.asdict(model_config_from_dict(migrated)))


def config_diff(saved: dict, current: dict, *, saved_as: str, current_as: str,
                 prefix: str = "model") -> list[str]:
  """Human-readable differences between two (nested) config dicts, as stored (no migration)."""
  out = []
  for key in sorted(set(saved) | set(current)):
    a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
      out += config_diff(a, b, saved_as=saved_as, current_as=current_as,
                          prefix=f"{prefix}.{key}")
    elif a != b:
      out.append(f"{prefix}.{key}: {a!r} {saved_as} vs {b!r} {current_as}")
  return out


def check_model_config(saved: dict[str, Any], current: dict[str, Any], *, what: str,
                       saved_as: str = "in the workdir", current_as: str = "now",
                       remedy: str = "") -> None:
  """ConfigError listing every field in which two model configs (dicts) differ (all of them
  count: the runtime settings live in `ComputeConfig`, outside the model config).

  Both go through the legacy migration, so a config written by older code compares equal to
  the same architecture written today. `what` opens the message; `remedy` ends it.
  """
  diff = config_diff(legacy_model_dict(saved), legacy_model_dict(current),
                      saved_as=saved_as, current_as=current_as)
  if diff:
    raise ConfigError(f"{what}: " + "; ".join(diff) + (f". {remedy}" if remedy else ""))


class CorruptConfigFile(ConfigError):
  """A stored model_config.json that cannot be read or parsed."""


def read_model_config(path: str) -> dict[str, Any] | None:
  """The model config stored in directory `path` (a workdir or an export), migrated to
  today's layout (`legacy_model_dict`); None if it has no CONFIG_FILE.

  Raises:
    CorruptConfigFile: the file exists but is truncated, not JSON or not a config (named).
  """
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file):
    return None
  try:
    with open(file, encoding="utf-8") as f:
      stored = json.load(f)
    if not isinstance(stored, dict):
      raise ValueError(f"a JSON {type(stored).__name__}, not an object")
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise CorruptConfigFile(f"the stored model config {file} is unreadable "
                            f"({type(e).__name__}: {' '.join(str(e).split())})") from None
  return legacy_model_dict(stored)


def check_workdir_config(workdir: str, model_dict: dict[str, Any], *, source: str | None = None,
                         saved: dict | None = None, repair: bool = False) -> None:
  """Raise ConfigError if the workdir's stored model config (or `saved`, the copy in a
  checkpoint's meta named by `source`) differs from `model_dict` in any field.

  repair: a training run's call. A corrupt workdir model_config.json (a crash while it was
    first written, a disk error) is moved aside to `model_config.json.corrupt-<ms>` with a
    warning instead of stopping the run: every checkpoint's meta holds its own copy of the
    config, which `restore_latest` checks, and the run writes the file anew.
  """
  if saved is None:
    try:
      saved = read_model_config(workdir)
    except CorruptConfigFile as e:
      if not repair:
        raise
      file = os.path.join(workdir, CONFIG_FILE)
      aside = f"{file}.corrupt-{int(time.time() * 1000)}"
      os.replace(file, aside)
      logging.warning("%s; moved it to %s (each checkpoint holds its own copy of the config, "
                      "which is checked on restore; the file is written anew)", e, aside)
      return
    if saved is None:
      return
    source = os.path.join(workdir, CONFIG_FILE)
  check_model_config(saved, model_dict,
                     what=f"workdir {workdir} holds a run of an incompatible model config "
                     f"({source})", remedy="Use a fresh --workdir or the original config.")


def write_json(path: str, record: dict[str, Any]) -> None:
  """`record` as JSON (indent 1, sorted keys) at `path`, through a temp file and a rename."""
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def write_workdir_config(workdir: str, model_dict: dict[str, Any]) -> None:
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    write_json(path, jsonify(model_dict))
