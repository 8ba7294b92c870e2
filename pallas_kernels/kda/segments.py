"""Packed sequences for the KDA kernels: the chunk-local segment index.

The kernels take packed documents as one float32 number per token, `seg` [B, Tp] (Tp = T
padded to a multiple of the chunk C): the token's segment counted from the segment of the
token just before its chunk (chunk 0: from token 0's segment, which owns the initial state).
So seg == 0 marks the rows that see the state entering the chunk, seg equal to the chunk's
last value marks the rows that reach the state leaving it, and equal values mark pairs of
tokens that may interact. Values are small integers (at most C), exact in float32, and
every chunk can hold any number of segment starts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_starts(segment_ids: jax.Array) -> jax.Array:
  """[B, T] bool: True where a token's segment id differs from the previous token's.

  Token 0 is never a start: the initial state belongs to the first token's segment.
  """
  seg = jnp.asarray(segment_ids)
  first = jnp.zeros_like(seg[:, :1], dtype=bool)
  return jnp.concatenate([first, seg[:, 1:] != seg[:, :-1]], axis=1)


def chunk_local_segments(segment_ids: jax.Array, chunk_size: int) -> jax.Array:
  """segment_ids [B, T] integers -> seg [B, Tp] float32 (see the module docstring).

  Padding tokens continue the last segment, so the state passes through them unchanged
  (their q = k = v = g = beta = 0 make them no-ops).
  """
  B, T = segment_ids.shape
  n = -(-T // chunk_size)
  sidx = jnp.cumsum(segment_starts(segment_ids), axis=1, dtype=jnp.int32)
  sidx = jnp.pad(sidx, ((0, 0), (0, n * chunk_size - T)), mode="edge")
  sidx = sidx.reshape(B, n, chunk_size)
  before = jnp.concatenate([sidx[:, :1, 0], sidx[:, :-1, -1]], axis=1)  # [B, N]
  return (sidx - before[..., None]).reshape(B, n * chunk_size).astype(jnp.float32)
