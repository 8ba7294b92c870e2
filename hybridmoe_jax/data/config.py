"""The `data` section of the run config, its checks, and the source it names.

Sizes that change between curriculum stages (seq_len, batch size) and the run seed are not
here: they are arguments of the pipeline factory, so a stage can rebuild the pipeline.
"""

from __future__ import annotations

import ml_collections

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.data import vlm_pipeline
from hybridmoe_jax.data import sources

SOURCES = ("bundled", "text", "jsonl")


def default_data_config() -> ml_collections.ConfigDict:
  """The `config.data` defaults: train on CPython's bundled help texts, fully offline."""
  c = ml_collections.ConfigDict()
  # Where documents come from: "bundled" (pydoc_data help texts), "text" or "jsonl".
  c.source = "bundled"
  # Files or directories for "text" / "jsonl" (directories are searched recursively).
  c.paths = ()
  # JSON key holding a document's text, for "jsonl".
  c.jsonl_field = "text"
  # Share of documents held out for evaluation (at least one document).
  c.heldout_fraction = 0.05
  # Seed of the train / held-out split; fixed apart from the run seed so that runs with
  # different seeds are evaluated on the same documents.
  c.heldout_seed = 0
  # Shuffle documents (reshuffled every epoch). False keeps source order.
  c.shuffle = True
  # Rows filled at once by the first-fit packer (more: less padding, more mixing).
  c.num_packing_bins = 16
  # Image-text data for vision models (model.vision.enabled); checked by
  # hybridmoe_jax.data.vlm_pipeline.validate_vision_data_config.
  c.vision = vlm_pipeline.default_vision_data_config()
  return c


def _require(ok: bool, field: str, value, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"config field `data.{field}` = {value!r} is invalid: allowed {allowed}")


def validate_data_config(cfg: ml_collections.ConfigDict) -> None:
  """Checks `cfg` (a `config.data` section).

  Raises:
    ConfigError (a ValueError) naming the first bad field.
  """
  _require(cfg.source in SOURCES, "source", cfg.source, f"one of {SOURCES}")
  paths = cfg.paths
  _require(isinstance(paths, (tuple, list)) and all(isinstance(p, str) and p for p in paths),
           "paths", paths, "a tuple of non-empty path strings")
  if cfg.source != "bundled":
    _require(len(paths) > 0, "paths", paths,
             f"at least one file or directory when data.source = {cfg.source!r}")
  _require(isinstance(cfg.jsonl_field, str) and cfg.jsonl_field, "jsonl_field",
           cfg.jsonl_field, "a non-empty string")
  frac = cfg.heldout_fraction
  _require(isinstance(frac, (int, float)) and 0.0 < frac <= 0.5, "heldout_fraction", frac,
           "a number in (0, 0.5]")
  _require(isinstance(cfg.heldout_seed, int) and cfg.heldout_seed >= 0, "heldout_seed",
           cfg.heldout_seed, "an integer >= 0")
  _require(isinstance(cfg.shuffle, bool), "shuffle", cfg.shuffle, "True or False")
  _require(isinstance(cfg.num_packing_bins, int) and cfg.num_packing_bins >= 1,
           "num_packing_bins", cfg.num_packing_bins, "an integer >= 1")


def source_from_config(cfg: ml_collections.ConfigDict):
  """Validates `cfg` and builds (indexes) the document source it names."""
  validate_data_config(cfg)
  if cfg.source == "bundled":
    return sources.BundledTextSource()
  if cfg.source == "text":
    return sources.TextFileSource(list(cfg.paths))
  return sources.JsonlSource(list(cfg.paths), field=cfg.jsonl_field)
