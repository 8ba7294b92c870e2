"""Gated multi-head latent attention without positional encoding (DESIGN s2).

Conventions: B batch, T tokens, d width, H heads, d_c latent (kv_lora_rank), Dn/Dr/Dv the
nope/rope-slot/value head dims, N cache capacity. The rope slot is a shared key part that is
never rotated.

Training runs over whole (packed) sequences, decoding continues from an `MLACache` (per
token only the latent c and the rope key k_r): both call `ops.attention.api`, whose
dispatch tables pick the core (XLA / kernels, the absorbed form, a context-parallel plan).

`cfg.rope_theta > 0` (an ablation of the NoPE design) rotates the rope slot, q_rope_h and k_r,
by RoPE at each token's position: its place in its own packed document when training, its
cache position when decoding (the cache then holds rotated k_r). Not under context
parallelism (the layer does not see the shards' positions).

`cfg.logn_base > 1` scales a query's scores by max(1, log n / log logn_base), n its position
(in its document, or in the cache) + 1: the keys it sees. Past logn_base tokens the softmax
then sharpens with the log of the length instead of flattening (Qwen's logn attention;
Scalable-Softmax, Nakanishi 2025). Same positions as RoPE; not under context parallelism.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, MLAConfig
from hybridmoe_jax.layers.linear import linear
from hybridmoe_jax.layers.norms import RMSNorm
from hybridmoe_jax.ops.attention.api import cached_latent_attention, latent_attention
from hybridmoe_jax.ops.plan import current_plan

_F32 = jnp.float32


def rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
  """RoPE of x [B, T, ..., D] (D even; halves rotated against each other) at positions
  pos [B, T] int32, base `theta`; computed in fp32, returned in x's dtype."""
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=_F32) / half)                 # [D/2]
  ang = pos.astype(_F32).reshape(pos.shape + (1,) * (x.ndim - 3))[..., None] * freq
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  x1, x2 = x[..., :half].astype(_F32), x[..., half:].astype(_F32)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def segment_positions(segment_ids: jax.Array | None, batch: int, t: int) -> jax.Array:
  """[B, T] int32: each token's position inside its own packed document (segment), counted
  from the segment's first token; without segment ids, 0..T-1."""
  idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
  if segment_ids is None:
    return idx
  new = jnp.concatenate([jnp.ones((batch, 1), bool),
                         segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return idx - jax.lax.cummax(jnp.where(new, idx, 0), axis=1)


def logn_scaled(q: jax.Array, pos: jax.Array, base: int) -> jax.Array:
  """q [B, T, H, D] times max(1, log(pos + 1) / log(base)) per token (pos [B, T] int32),
  computed in fp32, returned in q's dtype."""
  s = jnp.maximum(1.0, jnp.log1p(pos.astype(_F32)) / jnp.log(_F32(base)))
  return (q.astype(_F32) * s[:, :, None, None]).astype(q.dtype)


class MLACache(NamedTuple):
  """One MLA layer's decode cache (a pytree) in the compute dtype; grows with N by
  (d_c + Dr) * itemsize bytes per token."""

  c: jax.Array        # [B, N, d_c]
  k_r: jax.Array      # [B, N, Dr]  (Dr may be 0)

  @classmethod
  def zeros(cls, cfg: MLAConfig, batch: int, max_len: int, dtype: str) -> "MLACache":
    """An empty cache for `batch` rows of up to `max_len` tokens."""
    dt = jnp.dtype(dtype)
    return cls(c=jnp.zeros((batch, max_len, cfg.kv_lora_rank), dt),
               k_r=jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dt))


class MLALayer(nnx.Module):
  """q (optionally via q_lora), latent c = RMSNorm(W_dkv x), k = [W_uk c ; W_kr x], v = W_uv c."""

  def __init__(self, d_model: int, cfg: MLAConfig, *, norm_eps: float,
               compute: ComputeConfig = ComputeConfig(), rngs: nnx.Rngs,
               interpret: bool = False):
    """interpret: tests only: the Pallas cores (compute.mla_impl "triton", "splash") run in
    Pallas' interpreter, on any backend."""
    self.cfg = cfg
    self.dtype = jnp.dtype(compute.dtype)
    self.impl, self.block = compute.mla_impl, compute.mla_block
    self.interpret = interpret
    h = cfg.num_heads
    lin = lambda i, o: linear(i, o, dtype=compute.dtype, rngs=rngs)
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

  def _up_kernels(self) -> tuple[jax.Array, jax.Array]:
    """(W_uk [d_c, H, Dn], W_uv [d_c, H, Dv]) in the compute dtype."""
    cfg = self.cfg
    w_uk = self.k_up.kernel[...].reshape(cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim)
    w_uv = self.v_up.kernel[...].reshape(cfg.kv_lora_rank, cfg.num_heads, cfg.v_head_dim)
    return w_uk.astype(self.dtype), w_uv.astype(self.dtype)

  def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
               cache: MLACache | None = None, length: jax.Array | None = None,
               kv_block: int = 512) -> tuple[jax.Array, MLACache | None]:
    """x [B, T, d] -> (y [B, T, d] in the compute dtype, cache).

    Without a cache: the training forward; segment_ids [B, T] int32 (or None) are packed
    document ids; the returned cache is None.
    With a cache: row b's T new tokens sit at positions length[b] + i (length [B] int32, the
    tokens already cached per row); segment_ids > 0 marks the real tokens (a prefix of each
    row; None: all real), whose latents are written; each query sees the keys of its own row
    at positions <= its own. Positions past the capacity N are dropped (the caller checks).
    kv_block: keys per block of the absorbed attention.
    """
    cfg = self.cfg
    b, t, _ = x.shape
    x = x.astype(self.dtype)
    q = self.queries(x)
    c, k_r = self.latents(x)
    positional = (cfg.rope_theta and k_r is not None) or cfg.logn_base
    if positional and current_plan().context is not None:
      raise NotImplementedError("model.mla.rope_theta > 0 (RoPE) or logn_base > 0 under "
                                "context parallelism: the context runner does not pass the "
                                "shards' positions; set both 0 (the design) or no context axis")
    pos = None
    if positional:  # (a cache without length fails below)
      pos = (segment_positions(segment_ids, b, t) if cache is None
             else length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
             if length is not None else None)
    if pos is not None and cfg.rope_theta and k_r is not None:
      dn = cfg.qk_nope_head_dim
      q = jnp.concatenate([q[..., :dn], rope(q[..., dn:], pos, cfg.rope_theta)], axis=-1)
      k_r = rope(k_r, pos, cfg.rope_theta)
    if pos is not None and cfg.logn_base:
      q = logn_scaled(q, pos, cfg.logn_base)
    scale = cfg.qk_head_dim ** -0.5
    w_uk, w_uv = self._up_kernels()
    if k_r is None:
      k_r = jnp.zeros((b, t, 0), c.dtype)
    if cache is None:
      o = latent_attention(q, c, k_r, w_uk, w_uv, segment_ids=segment_ids, scale=scale,
                           impl=self.impl, block=self.block, interpret=self.interpret)
    else:
      if length is None:
        raise ValueError("MLALayer with a cache needs length: int32 [B] tokens already cached")
      n_valid = (jnp.full((b,), t, jnp.int32) if segment_ids is None
                 else jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32))
      o, cache = cached_latent_attention(q, c, k_r, cache, length, n_valid, w_uk, w_uv,
                                         scale=scale, kv_block=kv_block)
    o = o.astype(x.dtype).reshape(b, t, -1)
    if cfg.output_gate:
      o = o * jax.nn.sigmoid(self.gate(x).astype(jnp.float32)).astype(o.dtype)
    return self.o_proj(o), cache
