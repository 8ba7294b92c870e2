"""hybridmoe_jax: hybrid KDA/MLA sparse-MoE multimodal LLMs in JAX/Flax NNX.

The public names below load lazily, so `hybridmoe_jax.ops` imports with jax alone (no
flax, grain or ml_collections), as the accelerator test machines need.
"""

import importlib

_PUBLIC = {
    "ConfigError": "hybridmoe_jax.config",
    "ModelConfig": "hybridmoe_jax.config",
    "model_config_from_dict": "hybridmoe_jax.config",
    "HybridLM": "hybridmoe_jax.model",
    "count_params": "hybridmoe_jax.model",
    "load": "hybridmoe_jax.api",
    "LoadedModel": "hybridmoe_jax.api",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
  if name in _PUBLIC:
    return getattr(importlib.import_module(_PUBLIC[name]), name)
  raise AttributeError(f"module 'hybridmoe_jax' has no attribute {name!r}")
