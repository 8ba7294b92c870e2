"""Checkpoints of a real layout without real weights: every tensor's header entry with its
true shape and dtype, the data region left as holes of a sparse file (all zeros, no disk
blocks). Used to measure a conversion's host memory at full scale (e.g. the 48B layout)
on a machine without the weights (`benchmarks/convert_memory.py`, tests/convert).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import numpy as np

from hybridmoe_jax.convert import hf_config, hf_weights
from hybridmoe_jax.convert.convert import CONFIG_JSON, KEEP_F32, SHARD_BYTES
from hybridmoe_jax.io.safetensors import DTYPES, ShardedWriter, Spec

_ZERO_CHUNK = 64 * 2**20


def _zeros(spec: Spec) -> Iterator[np.ndarray]:
  left, dt = spec.nbytes, DTYPES[spec.dtype]
  while left:
    n = min(left, _ZERO_CHUNK)
    yield np.zeros(n // dt.itemsize, dt)
    left -= n


def hf_specs(hf: dict[str, Any], dtype: str = "BF16") -> list[Spec]:
  """Every tensor of the Kimi-Linear checkpoint `hf` (a config.json dict), in file order:
  weights in `dtype`, A_log / dt_bias / the correction biases float32 (as released)."""
  rules = hf_weights.weight_rules(hf_config.model_config_from_hf(hf))
  return [Spec(n, "F32" if n.endswith(KEEP_F32) else dtype, r.shapes[n])
          for r, n in hf_weights.outputs(rules, to="hf")]


def write_sparse_hf_checkpoint(path: str, hf: dict[str, Any], *, dtype: str = "BF16",
                               shard_bytes: int = SHARD_BYTES) -> dict[str, int]:
  """Write config.json and all-zero sparse shards of `hf`'s layout at `path` (new dir).

  Returns {"tensors", "bytes" (the logical size), "largest_tensor_bytes"}.
  """
  os.makedirs(path)
  specs = hf_specs(hf, dtype)
  writer = ShardedWriter(path, specs, prefix="model", max_shard_bytes=shard_bytes, sparse=True)
  for s in specs:
    writer.write(s.name, _zeros(s))
  writer.close()
  with open(os.path.join(path, CONFIG_JSON), "x", encoding="utf-8") as f:
    json.dump(hf, f, indent=1)
  return {"tensors": len(specs), "bytes": sum(s.nbytes for s in specs),
          "largest_tensor_bytes": max(s.nbytes for s in specs)}
