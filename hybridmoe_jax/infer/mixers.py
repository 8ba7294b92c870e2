"""Cached forward of the two mixers over a chunk of new tokens (prefill chunk or one token).

Conventions: B batch, P new tokens in the chunk (the last n_valid real, the rest padding),
d width, N cache capacity; see cache.py for the cache shapes. These functions read the
parameters of the training-time modules (`KDALayer`, `MLALayer`) and reproduce their
forward exactly, carrying the state that a full forward keeps implicit:
  * KDA: the conv taps reach back into the previous chunk's tail; the gated delta rule
    continues from the cached state (the op's initial_state / final_state). Padding tokens
    get beta = 0 and g = 0, which leaves the state unchanged exactly.
  * MLA: absorbed form (DESIGN s2). With W_uk [d_c, H, Dn] and W_uv [d_c, H, Dv]:
        q~_h = W_uk_h q_nope_h                 [d_c]
        s_j  = (q~_h . c_j + q_rope_h . k_r_j) / sqrt(Dn + Dr)
        o_h  = W_uv_h^T sum_j softmax(s)_j c_j
    i.e. one shared KV head [c ; k_r] of width d_c + Dr, attended blockwise with an online
    softmax so memory is O(P * kv_block), not O(P * N).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe_jax.infer.cache import KDACache, MLACache
from hybridmoe_jax.layers.kda import KDALayer, l2_normalize
from hybridmoe_jax.layers.mla import MLALayer
from hybridmoe_jax.layers.norms import rms_norm
from hybridmoe_jax.ops.kda import kda

_F32 = jnp.float32
_NEG = -1e30  # finite "minus infinity": fully masked blocks stay NaN-free


def conv_with_tail(weight: jax.Array, x: jax.Array, tail: jax.Array, n_valid: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
  """`ShortConv` continued from a tail: y_t = SiLU(sum_j w[j] x_{t-j}), fp32 inside.

  Args:
    weight: [W, C] fp32 taps (w[0] multiplies the current token).
    x: [B, P, C] conv inputs of the chunk.
    tail: [B, W-1, C] the W-1 inputs before the chunk (zeros at the sequence start).
    n_valid: int32 [] real tokens in the chunk; the new tail ends at the last real one.
  Returns:
    (y [B, P, C] in x's dtype, new tail [B, W-1, C]).
  """
  w = weight.shape[0]
  p = x.shape[1]
  full = jnp.concatenate([tail.astype(x.dtype), x], axis=1)          # [B, W-1+P, C]
  f32 = full.astype(_F32)
  y = sum(f32[:, w - 1 - j:w - 1 - j + p] * weight[j] for j in range(w))
  new_tail = jax.lax.dynamic_slice_in_dim(full, n_valid, w - 1, axis=1)
  return jax.nn.silu(y).astype(x.dtype), new_tail.astype(tail.dtype)


def kda_chunk(layer: KDALayer, x: jax.Array, cache: KDACache, n_valid: jax.Array
              ) -> tuple[jax.Array, KDACache]:
  """KDALayer forward over a chunk, continuing from `cache`.

  Args:
    layer: the trained KDALayer.
    x: [B, P, d] normalised mixer input.
    cache: KDACache before the chunk.
    n_valid: int32 [] real tokens (a prefix of the chunk).
  Returns:
    (y [B, P, d] compute dtype, cache after the n_valid real tokens).
  """
  cfg = layer.cfg
  b, p, _ = x.shape
  x = x.astype(layer.dtype)
  q, q_tail = conv_with_tail(layer.q_conv.weight[...], layer.q_proj(x), cache.q_tail, n_valid)
  k, k_tail = conv_with_tail(layer.k_conv.weight[...], layer.k_proj(x), cache.k_tail, n_valid)
  v, v_tail = conv_with_tail(layer.v_conv.weight[...], layer.v_proj(x), cache.v_tail, n_valid)
  q = l2_normalize(q.reshape(b, p, cfg.num_heads, cfg.head_dim))
  k = l2_normalize(k.reshape(b, p, cfg.num_heads, cfg.head_dim))
  v = v.reshape(b, p, cfg.num_v_heads, cfg.v_head_dim)
  real = (jnp.arange(p) < n_valid)[None, :, None]                     # [1, P, 1]
  beta = jnp.where(real, jax.nn.sigmoid(layer.b_proj(x).astype(_F32)), 0.0)
  g = jnp.where(real[..., None], layer.log_decay(x), 0.0)
  lower_bound = cfg.lower_bound if cfg.gate == "bounded" else None
  # One token: the exact recurrence is cheaper than building a 64-token chunk.
  impl = "recurrent" if p == 1 else cfg.impl
  o, state = kda(q, k, v, g, beta, initial_state=cache.state, output_final_state=True,
                 chunk_size=cfg.chunk_size, impl=impl, lower_bound=lower_bound)
  o = rms_norm(o, layer.o_norm_scale[...], layer.norm_eps)
  gate = jax.nn.sigmoid(layer.g_proj(x).astype(_F32)).astype(o.dtype)
  y = layer.o_proj(o.reshape(b, p, -1) * gate)
  return y, KDACache(q_tail, k_tail, v_tail, state)


def latent_attention(q_c: jax.Array, q_r: jax.Array, c: jax.Array, k_r: jax.Array,
                     q_pos: jax.Array, total: jax.Array, scale: float, kv_block: int
                     ) -> jax.Array:
  """Causal attention of P queries over one shared latent KV head, blockwise (flash style).

  Args:
    q_c: [B, P, H, d_c] absorbed queries; q_r: [B, P, H, Dr] rope-slot queries.
    c: [B, N, d_c] cached latents (keys and values); k_r: [B, N, Dr] cached rope keys.
    q_pos: [P] int32 absolute positions of the queries (key j is visible iff j <= q_pos).
    total: int32 [] filled positions; only ceil(total / kv_block) blocks are read, so the
      cost grows with the context, not with the capacity N.
    scale: logit scale.
    kv_block: keys per block.
  Returns:
    [B, P, H, d_c] float32: sum_j softmax_j c_j per query and head.
  """
  b, p, h, d_c = q_c.shape
  n = c.shape[1]
  blk = min(kv_block, n)
  n_blocks = (total + blk - 1) // blk

  def body(j, carry):
    m, l, acc = carry
    # The last block may overhang N: slide it back and mask what earlier blocks covered.
    start = jnp.minimum(j * blk, n - blk)
    cb = jax.lax.dynamic_slice_in_dim(c, start, blk, axis=1)
    rb = jax.lax.dynamic_slice_in_dim(k_r, start, blk, axis=1)
    s = (jnp.einsum("bphc,bnc->bphn", q_c, cb, preferred_element_type=_F32)
         + jnp.einsum("bphr,bnr->bphn", q_r, rb, preferred_element_type=_F32)) * scale
    k_pos = start + jnp.arange(blk)
    seen = (k_pos[None, :] >= j * blk) & (k_pos[None, :] <= q_pos[:, None])    # [P, blk]
    seen = seen[None, :, None, :]
    s = jnp.where(seen, s, _NEG)
    m_new = jnp.maximum(m, s.max(-1))
    e = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    acc = acc * corr[..., None] + jnp.einsum("bphn,bnc->bphc", e.astype(cb.dtype), cb,
                                             preferred_element_type=_F32)
    return m_new, l * corr + e.sum(-1), acc

  init = (jnp.full((b, p, h), _NEG, _F32), jnp.zeros((b, p, h), _F32),
          jnp.zeros((b, p, h, d_c), _F32))
  _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
  return acc / jnp.maximum(l, 1e-30)[..., None]


def _write(buf: jax.Array, new: jax.Array, start: jax.Array, n_valid: jax.Array) -> jax.Array:
  """buf[:, start + i] = new[:, i] for i < n_valid; padding rows are dropped."""
  n, p = buf.shape[1], new.shape[1]
  idx = start + jnp.arange(p)
  idx = jnp.where(jnp.arange(p) < n_valid, idx, n)   # out of range -> dropped
  return buf.at[:, idx].set(new.astype(buf.dtype), mode="drop")


def mla_chunk(layer: MLALayer, x: jax.Array, cache: MLACache, start: jax.Array,
              n_valid: jax.Array, *, kv_block: int = 512, absorbed: bool = True
              ) -> tuple[jax.Array, MLACache]:
  """MLALayer forward over a chunk at positions start.., attending to the cache.

  Args:
    layer: the trained MLALayer.
    x: [B, P, d] normalised mixer input.
    cache: MLACache holding positions < start.
    start: int32 [] position of the chunk's first token.
    n_valid: int32 [] real tokens in the chunk.
    kv_block: keys per attention block (absorbed form).
    absorbed: False -> expand k, v per head over the whole cache (reference for tests).
  Returns:
    (y [B, P, d] compute dtype, cache with the chunk's latents written).
  """
  cfg = layer.cfg
  b, p, _ = x.shape
  h, dn, dr, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  x = x.astype(layer.dtype)
  q = layer.queries(x)                                                   # [B, P, H, Dn+Dr]
  c_new, kr_new = layer.latents(x)
  if kr_new is None:
    kr_new = jnp.zeros((b, p, 0), c_new.dtype)
  cache = MLACache(_write(cache.c, c_new, start, n_valid),
                   _write(cache.k_r, kr_new, start, n_valid))
  q_pos = start + jnp.arange(p)
  scale = cfg.qk_head_dim ** -0.5
  w_uk = layer.k_up.kernel[...].reshape(cfg.kv_lora_rank, h, dn).astype(x.dtype)
  w_uv = layer.v_up.kernel[...].reshape(cfg.kv_lora_rank, h, dv).astype(x.dtype)
  if absorbed:
    q_c = jnp.einsum("bphn,chn->bphc", q[..., :dn], w_uk,
                     preferred_element_type=_F32).astype(x.dtype)
    o_c = latent_attention(q_c, q[..., dn:], cache.c, cache.k_r, q_pos, start + n_valid,
                           scale, kv_block)
    o = jnp.einsum("bphc,chv->bphv", o_c.astype(x.dtype), w_uv, preferred_element_type=_F32)
  else:
    o = _expanded_attention(q, cache, w_uk, w_uv, q_pos, scale)
  o = o.astype(x.dtype).reshape(b, p, h * dv)
  if cfg.output_gate:
    o = o * jax.nn.sigmoid(layer.gate(x).astype(_F32)).astype(o.dtype)
  return layer.o_proj(o), cache


def _expanded_attention(q, cache: MLACache, w_uk, w_uv, q_pos, scale) -> jax.Array:
  """Training-form attention over the whole cache: k_h = [W_uk_h c ; k_r], v_h = W_uv_h c."""
  b, n, _ = cache.c.shape
  h = w_uk.shape[1]
  k = jnp.einsum("bnc,chd->bnhd", cache.c, w_uk)
  k_r = jnp.broadcast_to(cache.k_r[:, :, None, :], (b, n, h, cache.k_r.shape[-1]))
  k = jnp.concatenate([k, k_r.astype(k.dtype)], axis=-1)
  v = jnp.einsum("bnc,chd->bnhd", cache.c, w_uv)
  s = jnp.einsum("bphd,bnhd->bhpn", q, k, preferred_element_type=_F32) * scale
  s = jnp.where((jnp.arange(n)[None, :] <= q_pos[:, None])[None, None], s, _NEG)
  probs = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhpn,bnhd->bphd", probs.astype(v.dtype), v, preferred_element_type=_F32)
