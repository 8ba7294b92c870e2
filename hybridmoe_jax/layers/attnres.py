"""Block Attention Residuals across depth (DESIGN s3).

Instead of x <- x + sublayer(norm(x)), each sub-layer (mixer or FFN) reads a softmax mix
over depth of its sources: the token embedding, the sums of completed blocks of layers, and
the running sum of the current block. Sources live in a fixed-size buffer
[num_blocks + 1, B, T, d] (slot 0 = embedding, slot j = block j's sum) with a validity mask,
so shapes never change with depth (static under jit and scan).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.layers.norms import rms_norm


def num_blocks(num_layers: int, block_size: int) -> int:
  """Blocks of `block_size` decoder layers; the last block may be shorter."""
  return -(-num_layers // block_size)


class BlockStream(NamedTuple):
  """The depth buffer: buf [S, B, T, d] (compute dtype), valid [S] bool."""

  buf: jax.Array
  valid: jax.Array

  @classmethod
  def start(cls, embedding: jax.Array, num_slots: int) -> "BlockStream":
    buf = jnp.zeros((num_slots,) + embedding.shape, embedding.dtype).at[0].set(embedding)
    return cls(buf, jnp.zeros((num_slots,), bool).at[0].set(True))

  def add(self, slot: int, out: jax.Array) -> "BlockStream":
    """Accumulate a sub-layer output into block `slot` (1-based) and mark it valid."""
    return BlockStream(self.buf.at[slot].add(out.astype(self.buf.dtype)),
                       self.valid.at[slot].set(True))


def depth_mix(query: jax.Array, buf: jax.Array, valid: jax.Array, eps: float) -> jax.Array:
  """h = sum_i softmax_i(w . RMSNorm(src_i)) src_i over the valid sources, fp32 softmax.

  Args:
    query: [d] pseudo-query w (zero -> uniform average of the valid sources).
    buf: [S, B, T, d] sources.
    valid: [S] bool.
  Returns:
    [B, T, d] in buf's dtype.
  """
  # No gain on the key norm: a gain g would be redundant with w (w . (g * n) = (w * g) . n).
  keys = rms_norm(buf.astype(jnp.float32), None, eps)
  logits = jnp.einsum("d,sbtd->sbt", query.astype(jnp.float32), keys)
  logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
  weights = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("sbt,sbtd->btd", weights, buf.astype(jnp.float32)).astype(buf.dtype)


class DepthMix(nnx.Module):
  """One sub-layer's learned pseudo-query [d], initialised to zero (uniform mixing)."""

  def __init__(self, d_model: int, *, eps: float):
    self.eps = eps
    self.query = nnx.Param(jnp.zeros((d_model,), jnp.float32))

  def __call__(self, stream: BlockStream, slots: int | None = None) -> jax.Array:
    """The mix over the first `slots` sources (a static count; None: all of them). Sources
    past the reading layer's own block are still empty, so an unrolled stack passes
    block + 1 and skips them: the result is the same, at block + 1 of num_slots the cost."""
    buf, valid = stream.buf, stream.valid
    if slots is not None:
      buf, valid = buf[:slots], valid[:slots]
    return depth_mix(self.query[...], buf, valid, self.eps)
