"""Training: config sections, train state, jitted steps, checkpoints, monitoring, the loop.

The public names below load lazily, so the flag checks of run_train.py / run_eval.py do not
pull in the loop's flax, optax and orbax imports.
"""

import importlib

_PUBLIC = {
    "default_config": "hybridmoe_jax.run_config",
    "train_and_evaluate": "hybridmoe_jax.train.loop",
    "TrainState": "hybridmoe_jax.train.state",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
  if name in _PUBLIC:
    return getattr(importlib.import_module(_PUBLIC[name]), name)
  raise AttributeError(f"module 'hybridmoe_jax.train' has no attribute {name!r}")
