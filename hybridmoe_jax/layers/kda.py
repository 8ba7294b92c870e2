"""Kimi Delta Attention layer (DESIGN s1.4).

Conventions: B batch, T tokens, d model width, H q/k heads, HV value heads, K key dim,
V value dim, W conv_size. Projections run in the compute dtype; the decay gate, its
parameters and the recurrent state are fp32.

Training runs over whole (packed) sequences. Decoding continues from a `KDACache`: the conv
tails (the last W-1 inputs of each short conv) and the recurrent state, constant in the
context length. A chunk's padding tokens get beta = 0 and g = 0, which leaves the state
unchanged exactly.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, KDAConfig
from hybridmoe_jax.layers.conv import ShortConv
from hybridmoe_jax.layers.linear import linear
from hybridmoe_jax.layers.norms import rms_norm
from hybridmoe_jax.ops.decay import bounded_log_decay, unbounded_log_decay
from hybridmoe_jax.ops.kda import kda


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x * rsqrt(sum(x^2) + eps) over the last axis, fp32 inside."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


class KDACache(NamedTuple):
  """One KDA layer's decode state (a pytree): conv tails in the compute dtype, state fp32."""

  q_tail: jax.Array   # [B, W-1, H*K]
  k_tail: jax.Array   # [B, W-1, H*K]
  v_tail: jax.Array   # [B, W-1, HV*V]
  state: jax.Array    # [B, HV, K, V] float32

  @classmethod
  def zeros(cls, cfg: KDAConfig, batch: int, dtype: str) -> "KDACache":
    """The cache of `batch` empty sequences."""
    w, hk = cfg.conv_size - 1, cfg.num_heads * cfg.head_dim
    dt = jnp.dtype(dtype)
    return cls(q_tail=jnp.zeros((batch, w, hk), dt), k_tail=jnp.zeros((batch, w, hk), dt),
               v_tail=jnp.zeros((batch, w, cfg.num_v_heads * cfg.v_head_dim), dt),
               state=jnp.zeros((batch, cfg.num_v_heads, cfg.head_dim, cfg.v_head_dim),
                               jnp.float32))


class KDALayer(nnx.Module):
  """Short convs -> L2-normalised q, k -> gated delta rule -> per-head norm -> gated output."""

  def __init__(self, d_model: int, cfg: KDAConfig, *, norm_eps: float,
               compute: ComputeConfig = ComputeConfig(), rngs: nnx.Rngs):
    """Where the recurrence and the short convolutions run (sequence shards under a
    context-parallel plan) is `ops.kda.kda`'s and `ops.conv.short_conv`'s choice."""
    self.cfg = cfg
    self.dtype = jnp.dtype(compute.dtype)
    self.impl, self.chunk_size = compute.kda_impl, compute.kda_chunk_size
    self.norm_eps = norm_eps
    hk, hvk, hvv = cfg.num_heads * cfg.head_dim, cfg.num_v_heads * cfg.head_dim, (
        cfg.num_v_heads * cfg.v_head_dim)
    lin = lambda i, o: linear(i, o, dtype=compute.dtype, rngs=rngs)
    self.q_proj, self.k_proj, self.v_proj = lin(d_model, hk), lin(d_model, hk), lin(d_model, hvv)
    conv = lambda c: ShortConv(c, cfg.conv_size, rngs=rngs)
    self.q_conv, self.k_conv, self.v_conv = conv(hk), conv(hk), conv(hvv)
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

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               cache: KDACache | None = None) -> tuple[jax.Array, KDACache | None]:
    """x [B, T, d] -> (y [B, T, d] in the compute dtype, cache).

    Without a cache: the training forward over whole sequences; segment_ids [B, T] int32
    (or None) are packed-document ids, and the returned cache is None.
    With a cache: T new tokens continue each row's sequence; segment_ids > 0 marks the real
    tokens (a prefix of each row), 0 padding (None: all real). Padding leaves the returned
    cache as if it were absent; its outputs are finite and meaningless. One token per row
    runs the exact recurrence (cheaper than one padded chunk).
    """
    cfg = self.cfg
    b, t, _ = x.shape
    x = x.astype(self.dtype)
    tails = (None, None, None) if cache is None else cache[:3]
    q, q_tail = self.q_conv(self.q_proj(x), segment_ids, cache=tails[0])
    k, k_tail = self.k_conv(self.k_proj(x), segment_ids, cache=tails[1])
    v, v_tail = self.v_conv(self.v_proj(x), segment_ids, cache=tails[2])
    q = l2_normalize(q.reshape(b, t, cfg.num_heads, cfg.head_dim))
    k = l2_normalize(k.reshape(b, t, cfg.num_heads, cfg.head_dim))
    v = v.reshape(b, t, cfg.num_v_heads, cfg.v_head_dim)
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    g = self.log_decay(x)
    lower_bound = cfg.lower_bound if cfg.gate == "bounded" else None
    state = None if cache is None else cache.state
    if cache is not None and segment_ids is not None:
      real = segment_ids > 0                                               # [B, T]
      beta = jnp.where(real[..., None], beta, 0.0)
      g = jnp.where(real[..., None, None], g, 0.0)
      segment_ids = None    # a cached chunk is one document; padding is beta = g = 0
    o, state = kda(q, k, v, g, beta, segment_ids=segment_ids, initial_state=state,
                   output_final_state=cache is not None, chunk_size=self.chunk_size,
                   impl="recurrent" if cache is not None and t == 1 else self.impl,
                   lower_bound=lower_bound)
    new_cache = None if cache is None else KDACache(q_tail, k_tail, v_tail, state)
    o = rms_norm(o, self.o_norm_scale[...], self.norm_eps)
    gate = jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32)).astype(o.dtype)
    o = o.reshape(b, t, -1) * gate
    return self.o_proj(o), new_cache
