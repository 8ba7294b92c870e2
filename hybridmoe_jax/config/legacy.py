"""Configs saved by older runs, in today's layout: the fields that moved out of the model /
train sections (`MOVED`) and the migration that puts them in place (`migrate_legacy`)."""

from __future__ import annotations

import copy
from typing import Any, Mapping


# Fields that moved out of the model / train sections: old name -> new name.
MOVED = {
    "model.dtype": "compute.dtype",
    "model.kda.impl": "compute.kda_impl",
    "model.kda.chunk_size": "compute.kda_chunk_size",
    "model.moe.capacity_factor": "compute.moe_capacity_factor",
    "train.remat": "compute.remat",
}


def plain(values):
  """ConfigDict (or FrozenConfigDict) -> dict; anything else unchanged."""
  return values.to_dict() if hasattr(values, "to_dict") else values


def migrate_legacy(d: Mapping[str, Any]) -> dict[str, Any]:
  """A root config dict as saved by older runs -> today's layout (a new dict).

  Each `MOVED` field found is taken out of its old section and put at its new place, unless
  the new place is already set; fields absent from `d` are left to the defaults of
  `run_config_from_dict`. Used on configs read back from a workdir (checkpoint meta
  "config"); for the model section alone (`model_config.json`) pass {"model": saved}.
  """
  out = copy.deepcopy(dict(plain(d)))
  for old, new in MOVED.items():
    *path, name = old.split(".")
    section = out
    for key in path:
      section = section.get(key) if isinstance(section, dict) else None
    if not isinstance(section, dict) or name not in section:
      continue
    value = section.pop(name)
    new_section, new_name = new.split(".")
    out.setdefault(new_section, {}).setdefault(new_name, value)
  return out
