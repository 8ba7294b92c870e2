"""The root ConfigDict every `configs/*.py` preset starts from.

Sections: `model` (-> `hybridmoe_jax.config.ModelConfig`), `train` (this file), `data`
(`hybridmoe_jax.data.config.default_data_config()`), `mesh` (device mesh sizes: the
training mesh of `hybridmoe_jax.parallel` and the dry-run memory estimate). Model defaults
come from the typed dataclasses, so each default is written once; `validate_train_config`
checks the rest before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import ml_collections

from hybridmoe_jax.config import ConfigError, ModelConfig
from hybridmoe_jax.sharding import MESH_AXES
from hybridmoe_jax.data.config import default_data_config
from hybridmoe_jax.train import curriculum as curriculum_lib

SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
REMAT = ("none", "full", "dots")


def _train_config() -> ml_collections.ConfigDict:
  t = ml_collections.ConfigDict()
  # Optimizer steps (one global batch each).
  t.steps = 300
  # Sequences per optimizer step (split into `grad_accum` microbatches).
  t.batch_size = 8
  # Tokens per packed sequence.
  t.seq_len = 256
  # Peak learning rate.
  t.lr = 3e-3
  # Linear warmup steps from 0 to `lr` (capped at `steps`).
  t.warmup = 30
  # "cosine" (to min_lr_ratio * lr), "wsd" (warmup-stable-decay) or "constant".
  t.schedule = "cosine"
  # Final learning rate as a fraction of `lr` (cosine and wsd).
  t.min_lr_ratio = 0.1
  # Fraction of the steps spent in the final decay of the wsd schedule.
  t.decay_fraction = 0.2
  # "adamw" or "muon" (optax.contrib.muon; AdamW for non-matrix parameters).
  t.optimizer = "adamw"
  # Adam moments.
  t.b1 = 0.9
  t.b2 = 0.95
  # Decoupled weight decay, applied to matrices only (not norms, gains, routing biases).
  t.weight_decay = 0.1
  # Global-norm gradient clipping threshold; 0 disables.
  t.clip = 1.0
  # Microbatches per step; must divide batch_size. Routing stats are summed over them.
  t.grad_accum = 1
  # Rematerialisation policy: "none", "full" or "dots".
  t.remat = "none"
  # Progress line / TensorBoard / JSONL every N steps.
  t.log_every = 10
  # Held-out evaluation every N steps (and at the end); 0: only at the end.
  t.eval_every = 100
  # Batches per evaluation.
  t.eval_batches = 8
  # Checkpoint every N steps (and at the end and on SIGINT); 0: only at the end.
  t.checkpoint_every = 100
  # Checkpoints kept in workdir/checkpoints.
  t.keep_checkpoints = 3
  # Write checkpoints in a background thread.
  t.async_checkpoints = True
  # Seed of parameter init and the training RNG.
  t.seed = 0
  # Alert when a layer's MaxVio stays above this for `maxvio_alert_steps` consecutive steps.
  t.maxvio_alert_threshold = 0.5
  t.maxvio_alert_steps = 50
  # Alert when the loss exceeds this factor times its running mean.
  t.loss_spike_factor = 1.5
  # Expert-load heatmap PNG every N steps (and at the end); 0 disables.
  t.heatmap_every = 50
  return t


def _mesh_config() -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()
  # Mesh axis sizes; -1 takes the remaining devices; the product must equal the number of
  # devices of all processes. Batch over data x fsdp, experts over expert (parallel/rules.py).
  m.data = 1
  m.fsdp = -1
  m.expert = 1
  m.tensor = 1
  return m


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
  """Root config: `model`, `train`, `data` and `mesh` sections."""
  model = dataclasses.asdict(ModelConfig())
  model["layer_kinds"] = ()
  config = ml_collections.ConfigDict()
  config.model = ml_collections.ConfigDict(model)
  config.train = _train_config()
  config.data = default_data_config()
  config.mesh = _mesh_config()
  config.curriculum = curriculum_lib.default_curriculum_config()
  return config


def _check(ok: bool, field: str, value: Any, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"config field `{field}` = {value!r} is invalid: allowed {allowed}")


def _int(t, name: str, lo: int, allowed: str | None = None) -> None:
  v = t[name]
  _check(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"train.{name}", v,
         allowed or f"an integer >= {lo}")


def _num(t, name: str, lo: float, hi: float, allowed: str) -> None:
  v = t[name]
  _check(isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi,
         f"train.{name}", v, allowed)


def validate_train_config(config: ml_collections.ConfigDict) -> None:
  """Check the `train` and `mesh` sections; raise `ConfigError` (a ValueError) naming the field."""
  known = set(_train_config().keys())
  unknown = sorted(set(config.train.keys()) - known)
  _check(not unknown, "train", unknown, f"fields among {sorted(known)}")
  t = config.train
  for name in ("steps", "batch_size", "grad_accum", "log_every", "keep_checkpoints"):
    _int(t, name, 1)
  _int(t, "seq_len", 2)
  for name in ("warmup", "eval_every", "checkpoint_every", "heatmap_every", "seed"):
    _int(t, name, 0)
  _int(t, "eval_batches", 1)
  _int(t, "maxvio_alert_steps", 1)
  _check(t.batch_size % t.grad_accum == 0, "train.grad_accum", t.grad_accum,
         f"a divisor of batch_size={t.batch_size}")
  _num(t, "lr", 1e-12, 10.0, "a float in (0, 10]")
  _num(t, "min_lr_ratio", 0.0, 1.0, "a float in [0, 1]")
  _num(t, "decay_fraction", 0.0, 1.0, "a float in [0, 1]")
  _num(t, "b1", 0.0, 0.999999, "a float in [0, 1)")
  _num(t, "b2", 0.0, 0.999999, "a float in [0, 1)")
  _num(t, "weight_decay", 0.0, 10.0, "a float in [0, 10]")
  _num(t, "clip", 0.0, float("inf"), "a float >= 0 (0 disables clipping)")
  _num(t, "maxvio_alert_threshold", 0.0, float("inf"), "a float >= 0")
  _num(t, "loss_spike_factor", 1.0, float("inf"), "a float >= 1")
  _check(t.schedule in SCHEDULES, "train.schedule", t.schedule, f"one of {SCHEDULES}")
  _check(t.optimizer in OPTIMIZERS, "train.optimizer", t.optimizer, f"one of {OPTIMIZERS}")
  _check(t.remat in REMAT, "train.remat", t.remat, f"one of {REMAT}")
  _check(isinstance(t.async_checkpoints, bool), "train.async_checkpoints",
         t.async_checkpoints, "True or False")
  validate_mesh_config(config.mesh)
  if "curriculum" in config:
    curriculum_lib.validate_curriculum_config(config)


def validate_mesh_config(mesh: ml_collections.ConfigDict) -> None:
  unknown = sorted(set(mesh.keys()) - set(MESH_AXES))
  _check(not unknown, "mesh", unknown, f"axes among {MESH_AXES}")
  free = 0
  for axis in MESH_AXES:
    v = mesh[axis]
    _check(isinstance(v, int) and (v >= 1 or v == -1), f"mesh.{axis}", v,
           "an integer >= 1, or -1 for the remaining devices")
    free += v == -1
  _check(free <= 1, "mesh", mesh.to_dict(), "at most one axis of size -1")


def mesh_shape(mesh: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
  """Resolve -1 to the remaining devices; check that the sizes multiply to `num_devices`."""
  validate_mesh_config(mesh)
  sizes = {a: int(mesh[a]) for a in MESH_AXES}
  fixed = 1
  for v in sizes.values():
    fixed *= v if v > 0 else 1
  for a, v in sizes.items():
    if v == -1:
      _check(num_devices % fixed == 0, f"mesh.{a}", v,
             f"-1 only when the other axes ({fixed}) divide the {num_devices} devices")
      sizes[a] = num_devices // fixed
  total = 1
  for v in sizes.values():
    total *= v
  _check(total == num_devices, "mesh", sizes,
         f"axis sizes whose product is the {num_devices} device(s)")
  return sizes
