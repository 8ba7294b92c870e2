"""Load a Hugging Face Kimi-Linear directory straight into a HybridLM (in memory).

The weights go through the same rules as the converter (`hf_weights`), one tensor at a
time, cast to our float32 parameters; the correction biases become the routing-bias state.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridmoe_jax.config import ComputeConfig
from hybridmoe_jax.convert import hf_config, hf_weights
from hybridmoe_jax.convert.convert import iter_our_tensors, read_hf_config
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.train.params_export import nest
from hybridmoe_jax.train.state import split_model


def load_hf_model(path: str, compute: ComputeConfig | None = None
                  ) -> tuple[HybridLM, dict[str, Any]]:
  """A Kimi-Linear HF dir -> (HybridLM with its weights, info).

  info: {"source": "huggingface", "path", "hf_config" (the config.json dict)}.
  Raises UnsupportedConfig / TensorMismatch (naming fields / tensors) before building.
  """
  hf = read_hf_config(path)
  cfg = hf_config.model_config_from_hf(hf)
  compute = compute or ComputeConfig()
  abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute))
  graphdef, params, biases, rest = split_model(abstract)
  flat = {hf_weights.P: {}, hf_weights.B: {}}
  for name, value in iter_our_tensors(path):
    prefix = hf_weights.P if name.startswith(hf_weights.P) else hf_weights.B
    flat[prefix][name[len(prefix):]] = jnp.asarray(value.astype(np.float32))
  nnx.replace_by_pure_dict(params, nest(flat[hf_weights.P]))
  nnx.replace_by_pure_dict(biases, nest(flat[hf_weights.B]))
  model = nnx.merge(graphdef, params, biases, rest)
  return model, {"source": "huggingface", "path": os.path.abspath(path), "hf_config": hf}
