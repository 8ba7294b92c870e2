"""The root ConfigDict every `configs/*.py` preset starts from.

Defaults come from the typed dataclasses, so each default is written once.
"""

import dataclasses

import ml_collections

from hybridmoe_jax.config import ModelConfig


def default_config() -> ml_collections.ConfigDict:
  """Root config: `model` (-> ModelConfig); training sections are added by the train package."""
  model = dataclasses.asdict(ModelConfig())
  model["layer_kinds"] = ()
  config = ml_collections.ConfigDict()
  config.model = ml_collections.ConfigDict(model)
  return config
