"""Functional forms of `Engine`'s calls: a model in, one call out (a fresh Engine each time;
compilations are shared across calls with the same shapes, the graphdef being static)."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from hybridmoe_jax.infer.engine import Engine, GenerateOutput
from hybridmoe_jax.infer.sampling import SamplingConfig
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.cache import DecodeCache


def prefill(model: HybridLM, tokens, *, max_len: int, chunk_size: int = 256,
            kv_block: int = 512, cache: DecodeCache | None = None
            ) -> tuple[jax.Array, DecodeCache]:
  """Functional `Engine.prefill`: tokens [B, T] -> (logits [B, V], cache of capacity max_len).

  Compilations are shared across calls with the same shapes (the graphdef is static).
  """
  engine = Engine(model, max_len=max_len, prefill_chunk=chunk_size, kv_block=kv_block)
  return engine.prefill(tokens, cache)


def decode_step(model: HybridLM, token, cache: DecodeCache, *, kv_block: int = 512
                ) -> tuple[jax.Array, DecodeCache]:
  """Functional `Engine.decode_step`: token [B] -> (logits [B, V], cache); capacity = cache's."""
  return Engine(model, max_len=cache.max_len, kv_block=kv_block).decode_step(token, cache)


def generate(model: HybridLM, prompt, *, max_new_tokens: int, max_len: int | None = None,
             sampling: SamplingConfig = SamplingConfig(), stop_tokens: Sequence[int] = (),
             seed: int = 0, chunk_size: int = 256, kv_block: int = 512,
             pad_id: int = 0) -> GenerateOutput:
  """Functional `Engine.generate`; max_len defaults to prompt + max_new_tokens."""
  t = np.asarray(prompt).shape[-1]
  engine = Engine(model, max_len=max_len or t + max_new_tokens, prefill_chunk=chunk_size,
                  kv_block=kv_block)
  return engine.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                         stop_tokens=stop_tokens, seed=seed, pad_id=pad_id)
