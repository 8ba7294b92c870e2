"""Next-token cross-entropy from the last hidden state, vocabulary block by block.

The loss never holds the [B, T, V] fp32 logits: each block of `block` vocabulary columns
computes its logits, their logsumexp and the target's logit, under `jax.checkpoint`, so the
backward recomputes that block instead of keeping it (K3's and Kimi-Linear's V = 163,840:
f32[4096, 163840] is 2.5 GiB per 4,096-token row, and its softmax gradient as much again).
The blocks' logsumexps combine exactly (a logsumexp of logsumexps). The block loop is a
Python loop (static slices of the head), not a scan, so XLA's cost analysis counts every
block (it counts a loop body once).
`token_nll` is the exact reference over whole logits (tests compare the two, forward and
backward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
VOCAB_BLOCK = 16_384   # columns per block: [B_local, T_local, 16384] fp32 at a time


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Reference: logits [B, T, V] (any float), targets [B, T] int -> NLL [B, T] fp32."""
  logits = logits.astype(_F32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return logz - picked


def _block(h: jax.Array, w: jax.Array, targets: jax.Array, start: int):
  """One vocabulary block: h [B, T, d] fp32, w [d, Vb] fp32 (columns start .. start + Vb)
  -> (logsumexp [B, T], target logit where the target is in this block else 0) fp32."""
  logits = jnp.dot(h, w, preferred_element_type=_F32)
  local = targets - start
  inside = (local >= 0) & (local < w.shape[1])
  picked = jnp.take_along_axis(logits, jnp.clip(local, 0, w.shape[1] - 1)[..., None],
                               axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1), jnp.where(inside, picked, 0.0)


_block_remat = jax.checkpoint(_block, static_argnums=(3,),
                              policy=jax.checkpoint_policies.nothing_saveable)


def blocked_token_nll(h: jax.Array, w: jax.Array, targets: jax.Array, *,
                      block: int = VOCAB_BLOCK) -> jax.Array:
  """NLL [B, T] fp32 of `targets` under logits = h @ w, `block` vocabulary columns at a time.

  Args:
    h: [B, T, d] last hidden state (after the final norm); the head runs in fp32.
    w: [d, V] the LM head (fp32).
    targets: [B, T] int32 in [0, V).
    block: vocabulary columns per block (the last block may be narrower); >= V: one block.

  Returns:
    [B, T] fp32, equal to `token_nll(h @ w, targets)` up to rounding.
  """
  if block < 1:
    raise ValueError(f"block = {block}: allowed an int >= 1 (vocabulary columns per block)")
  h = h.astype(_F32)
  w = w.astype(_F32)
  vocab = w.shape[1]
  targets = targets.astype(jnp.int32)
  if vocab <= block:
    lse, picked = _block(h, w, targets, 0)
    return lse - picked
  lses, picked = [], 0.0
  for start in range(0, vocab, block):
    lse, pick = _block_remat(h, w[:, start:start + block], targets, start)
    lses.append(lse)
    picked = picked + pick
  return jax.nn.logsumexp(jnp.stack(lses), axis=0) - picked
