"""The root ConfigDict every `configs/*.py` preset starts from, and preset loading.

Sections: `model` (`hybridmoe_jax.config.ModelConfig`), `compute` (`ComputeConfig`: dtype,
remat, kernels), `train`, `data` (with `vision`), `mesh`, `curriculum`, `hardware` and `rl`
(`hybridmoe_jax.rl_config`) (the
dataclasses of `hybridmoe_jax.run_config`). The defaults are those dataclasses' defaults, so each is
written once; `run_config_from_dict` checks a finished ConfigDict (presets plus
`--config.x.y=` overrides) and builds the typed `RunConfig` the run takes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import ml_collections

from hybridmoe_jax.config import ConfigError, from_dict
from hybridmoe_jax.run_config import MeshConfig, RunConfig


def load_config_file(path: str | os.PathLike) -> ml_collections.ConfigDict:
  """`get_config()` of a config file such as configs/tiny.py (presets build on each other)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path} does not exist")
  name = "_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def default_config() -> ml_collections.ConfigDict:
  """Root config: `model`, `compute`, `train`, `data`, `mesh`, `curriculum`, `hardware`, `rl`."""
  fields = dataclasses.asdict(RunConfig())
  fields["model"]["layer_kinds"] = ()  # () -> the default pattern of whatever num_layers
  return ml_collections.ConfigDict(fields)
