"""The LM head: last hidden state -> fp32 logits, and the training loss that never forms them.

One parameter, `kernel` [d, V] fp32 (the path `lm_head/kernel` of a plain bias-free linear
layer, so checkpoints and conversions are unchanged). The head runs in fp32, so logits and
the loss are fp32 whatever the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.ops.cross_entropy import blocked_token_nll

_F32 = jnp.float32


class LMHead(nnx.Module):
  """kernel [d, V] fp32 ~ N(0, 1/d)."""

  def __init__(self, d_model: int, vocab_size: int, *, rngs: nnx.Rngs):
    init = nnx.initializers.normal(stddev=d_model ** -0.5)
    self.kernel = nnx.Param(init(rngs.params(), (d_model, vocab_size), _F32))

  def __call__(self, h: jax.Array) -> jax.Array:
    """h [..., d] -> logits [..., V] fp32."""
    return jnp.dot(h.astype(_F32), self.kernel[...])

  def nll(self, h: jax.Array, targets: jax.Array) -> jax.Array:
    """h [B, T, d], targets [B, T] int32 -> NLL [B, T] fp32, vocabulary block by block
    (`ops.cross_entropy.blocked_token_nll`: no [B, T, V] logits, forward or backward)."""
    return blocked_token_nll(h, self.kernel[...], targets)
