"""Gated multi-head latent attention without positional encoding (DESIGN s2).

Conventions: B batch, T tokens, d width, H heads, d_c latent (kv_lora_rank), Dn/Dr/Dv the
nope/rope-slot/value head dims. The rope slot is a shared key part that is never rotated.
Training and prefill use the expanded form below; decode will absorb W_uk into the query.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import MLAConfig
from hybridmoe_jax.layers.linear import linear
from hybridmoe_jax.layers.norms import RMSNorm
from hybridmoe_jax.ops.attention import causal_attention


class MLALayer(nnx.Module):
  """q (optionally via q_lora), latent c = RMSNorm(W_dkv x), k = [W_uk c ; W_kr x], v = W_uv c."""

  def __init__(self, d_model: int, cfg: MLAConfig, *, norm_eps: float, dtype: str,
               rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = jnp.dtype(dtype)
    h = cfg.num_heads
    lin = lambda i, o: linear(i, o, dtype=dtype, rngs=rngs)
    if cfg.q_lora_rank:
      self.q_a = lin(d_model, cfg.q_lora_rank)
      self.q_norm = RMSNorm(cfg.q_lora_rank, eps=norm_eps)
      self.q_b = lin(cfg.q_lora_rank, h * cfg.qk_head_dim)
    else:
      self.q_proj = lin(d_model, h * cfg.qk_head_dim)
    self.kv_a = lin(d_model, cfg.kv_lora_rank)
    self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=norm_eps)
    if cfg.qk_rope_head_dim:
      self.k_rope = lin(d_model, cfg.qk_rope_head_dim)
    self.k_up = lin(cfg.kv_lora_rank, h * cfg.qk_nope_head_dim)   # W_uk
    self.v_up = lin(cfg.kv_lora_rank, h * cfg.v_head_dim)         # W_uv
    if cfg.output_gate:
      self.gate = lin(d_model, h * cfg.v_head_dim)
    self.o_proj = lin(h * cfg.v_head_dim, d_model)

  def queries(self, x: jax.Array) -> jax.Array:
    """x: [B, T, d] -> q: [B, T, H, Dn + Dr]."""
    q = self.q_b(self.q_norm(self.q_a(x))) if self.cfg.q_lora_rank else self.q_proj(x)
    return q.reshape(*x.shape[:2], self.cfg.num_heads, self.cfg.qk_head_dim)

  def latents(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """x: [B, T, d] -> (c: [B, T, d_c], k_r: [B, T, Dr] or None): what a decode cache holds."""
    k_r = self.k_rope(x) if self.cfg.qk_rope_head_dim else None
    return self.kv_norm(self.kv_a(x)), k_r

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
    """x: [B, T, d] -> [B, T, d]; segment_ids [B, T] int32 or None."""
    cfg = self.cfg
    b, t, _ = x.shape
    x = x.astype(self.dtype)
    q = self.queries(x)
    c, k_r = self.latents(x)
    k = self.k_up(c).reshape(b, t, cfg.num_heads, cfg.qk_nope_head_dim)
    if k_r is not None:
      k_r = jnp.broadcast_to(k_r[:, :, None, :], (b, t, cfg.num_heads, cfg.qk_rope_head_dim))
      k = jnp.concatenate([k, k_r], axis=-1)
    v = self.v_up(c).reshape(b, t, cfg.num_heads, cfg.v_head_dim)
    o = causal_attention(q, k, v, segment_ids=segment_ids, scale=cfg.qk_head_dim ** -0.5)
    o = o.reshape(b, t, -1)
    if cfg.output_gate:
      o = o * jax.nn.sigmoid(self.gate(x).astype(jnp.float32)).astype(o.dtype)
    return self.o_proj(o)
