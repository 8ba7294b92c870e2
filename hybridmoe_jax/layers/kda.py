"""Kimi Delta Attention layer (DESIGN s1.4).

Conventions: B batch, T tokens, d model width, H q/k heads, HV value heads, K key dim,
V value dim. Projections run in the compute dtype; the decay gate, its parameters and the
recurrent state are fp32.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridmoe_jax.config import KDAConfig
from hybridmoe_jax.layers.conv import ShortConv
from hybridmoe_jax.layers.linear import linear
from hybridmoe_jax.layers.norms import rms_norm
from hybridmoe_jax.ops.decay import bounded_log_decay, unbounded_log_decay
from hybridmoe_jax.ops.kda import kda


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x * rsqrt(sum(x^2) + eps) over the last axis, fp32 inside."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


class KDALayer(nnx.Module):
  """Short convs -> L2-normalised q, k -> gated delta rule -> per-head norm -> gated output."""

  def __init__(self, d_model: int, cfg: KDAConfig, *, norm_eps: float, dtype: str,
               rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = jnp.dtype(dtype)
    self.norm_eps = norm_eps
    hk, hvk, hvv = cfg.num_heads * cfg.head_dim, cfg.num_v_heads * cfg.head_dim, (
        cfg.num_v_heads * cfg.v_head_dim)
    lin = lambda i, o: linear(i, o, dtype=dtype, rngs=rngs)
    self.q_proj, self.k_proj, self.v_proj = lin(d_model, hk), lin(d_model, hk), lin(d_model, hvv)
    self.q_conv = ShortConv(hk, cfg.conv_size, rngs=rngs)
    self.k_conv = ShortConv(hk, cfg.conv_size, rngs=rngs)
    self.v_conv = ShortConv(hvv, cfg.conv_size, rngs=rngs)
    self.f_a, self.f_b = lin(d_model, cfg.decay_rank), lin(cfg.decay_rank, hvk)
    self.b_proj = lin(d_model, cfg.num_v_heads)
    if cfg.gate == "bounded":
      # A_log = 0 (DESIGN s1.4). dt_bias puts sigmoid's argument in [-6, -2] so the initial
      # per-token decays exp(g) lie in ~[0.6, 0.99]: long memory at the start of training.
      a_log = jnp.zeros((cfg.num_v_heads,), jnp.float32)
      dt_bias = jax.random.uniform(rngs.params(), (hvk,), jnp.float32, -6.0, -2.0)
    else:
      # Mamba-style: A in [1, 16], dt in [1e-3, 1e-1] through an inverse softplus.
      a_log = jnp.log(jax.random.uniform(rngs.params(), (cfg.num_v_heads,), jnp.float32, 1, 16))
      dt = jnp.exp(jax.random.uniform(rngs.params(), (hvk,), jnp.float32,
                                      np.log(1e-3), np.log(1e-1)))
      dt_bias = dt + jnp.log(-jnp.expm1(-dt))
    self.a_log, self.dt_bias = nnx.Param(a_log), nnx.Param(dt_bias)
    rank = cfg.out_gate_rank
    if rank is None:
      self.g_proj = lin(d_model, hvv)
    else:
      self.g_proj = nnx.Sequential(lin(d_model, rank), lin(rank, hvv))
    self.o_norm_scale = nnx.Param(jnp.ones((cfg.v_head_dim,), jnp.float32))
    self.o_proj = lin(hvv, d_model)

  def log_decay(self, x: jax.Array) -> jax.Array:
    """x: [B, T, d] -> g: [B, T, HV, K] fp32 log decay (bounded or unbounded gate)."""
    cfg = self.cfg
    g_raw = self.f_b(self.f_a(x)).astype(jnp.float32)
    g_raw = g_raw.reshape(*x.shape[:2], cfg.num_v_heads, cfg.head_dim)
    dt_bias = self.dt_bias[...].reshape(cfg.num_v_heads, cfg.head_dim)
    if cfg.gate == "bounded":
      return bounded_log_decay(g_raw, lower_bound=cfg.lower_bound, a_log=self.a_log[...],
                               dt_bias=dt_bias)
    return unbounded_log_decay(g_raw, a_log=self.a_log[...], dt_bias=dt_bias)

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
    """x: [B, T, d] in the compute dtype -> [B, T, d]; segment_ids [B, T] int32 or None."""
    cfg = self.cfg
    b, t, _ = x.shape
    x = x.astype(self.dtype)
    q = self.q_conv(self.q_proj(x), segment_ids).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = self.k_conv(self.k_proj(x), segment_ids).reshape(b, t, cfg.num_heads, cfg.head_dim)
    v = self.v_conv(self.v_proj(x), segment_ids).reshape(b, t, cfg.num_v_heads, cfg.v_head_dim)
    q, k = l2_normalize(q), l2_normalize(k)
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    g = self.log_decay(x)
    lower_bound = cfg.lower_bound if cfg.gate == "bounded" else None
    o, _ = kda(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=cfg.chunk_size,
               impl=cfg.impl, lower_bound=lower_bound)
    o = rms_norm(o, self.o_norm_scale[...], self.norm_eps)
    gate = jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32)).astype(o.dtype)
    o = o.reshape(b, t, -1) * gate
    return self.o_proj(o)
