"""Gated multi-head latent attention without positional encoding (DESIGN s2).

Conventions: B batch, T tokens, d width, H heads, d_c latent (kv_lora_rank), Dn/Dr/Dv the
nope/rope-slot/value head dims, N cache capacity. The rope slot is a shared key part that is
never rotated.

Training runs the expanded form over whole (packed) sequences, with the core that
`compute.mla_impl` resolves to (`ops.attention_backends`): dense [T, T] scores or blockwise
(O(T x block) memory) in XLA, or the accelerator kernels cuDNN / Triton / splash. Decoding
continues from an `MLACache` (per token only the latent c and the rope key k_r) in the
absorbed form. With W_uk [d_c, H, Dn] and W_uv [d_c, H, Dv]:
    q~_h = W_uk_h q_nope_h                 [d_c]
    s_j  = (q~_h . c_j + q_rope_h . k_r_j) / sqrt(Dn + Dr)
    o_h  = W_uv_h^T sum_j softmax(s)_j c_j
i.e. one shared KV head [c ; k_r] of width d_c + Dr, attended blockwise with an online
softmax, so memory is O(T * kv_block), not O(T * N).

`cfg.rope_theta > 0` (an ablation of the NoPE design) rotates the rope slot, q_rope_h and k_r,
by RoPE at each token's position: its place in its own packed document when training, its
cache position when decoding (the cache then holds rotated k_r). Not under context
parallelism (the layer does not see the shards' positions).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, MLAConfig
from hybridmoe_jax.layers.linear import linear
from hybridmoe_jax.layers.norms import RMSNorm
from hybridmoe_jax.ops import attention_backends as backends

_F32 = jnp.float32
_NEG = -1e30  # finite "minus infinity": fully masked blocks stay NaN-free


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


def _write(buf: jax.Array, new: jax.Array, start: jax.Array, n_valid: jax.Array) -> jax.Array:
  """buf[b, start[b] + i] = new[b, i] for i < n_valid[b]; padding (and overflow) dropped."""
  b, n = buf.shape[:2]
  i = jnp.arange(new.shape[1])[None, :]
  idx = jnp.where(i < n_valid[:, None], start[:, None] + i, n)    # out of range -> dropped
  return buf.at[jnp.arange(b)[:, None], idx].set(new.astype(buf.dtype), mode="drop")


def latent_attention_partial(q_c: jax.Array, q_r: jax.Array, c: jax.Array, k_r: jax.Array,
                             q_pos: jax.Array, total: jax.Array, scale: float, kv_block: int
                             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Causal attention of T queries over one shared latent KV head, blockwise (flash style),
  left unnormalised so that attention over pieces of a cache can be merged exactly
  (`parallel.context_decode` merges the pieces held by different devices).

  Args:
    q_c: [B, T, H, d_c] absorbed queries; q_r: [B, T, H, Dr] rope-slot queries.
    c: [B, N, d_c] cached latents (keys and values); k_r: [B, N, Dr] cached rope keys.
    q_pos: [B, T] int32 positions of the queries in their row (key j visible iff j <= q_pos).
    total: [B] int32 filled positions per row; only ceil(total / kv_block) blocks of a row
      are read, so the cost grows with the context, not with the capacity N (queries past
      `total`, i.e. padding, see no keys beyond it).
    scale: logit scale.
    kv_block: keys per block.
  Returns:
    (m [B, T, H] running max of the logits (-1e30 where no key is visible), l [B, T, H] sum
    of exp(s - m), acc [B, T, H, d_c] sum of exp(s - m) c), all float32.
  """
  b, t, h, d_c = q_c.shape
  n = c.shape[1]
  blk = min(kv_block, n)
  q = jnp.concatenate([q_c, q_r], axis=-1).reshape(b, t * h, -1)   # heads share the keys

  def row(q, c, k_r, q_pos, total):
    """One row: q [T*H, D], c [N, d_c], k_r [N, Dr], q_pos [T], total []. Vmapped, so each
    row's blocks take the masked or the unmasked path by its own positions alone (a row's
    bits do not depend on which other rows share the batch)."""
    n_blocks = (total + blk - 1) // blk
    # Blocks that every query sees whole need no mask: on CPU the masks cost as much as the
    # block's matmuls (2.4x slower at 128K), and at long context nearly every block is such.
    n_full = jnp.clip((jnp.min(q_pos) + 1) // blk, 0, jnp.minimum(n_blocks, n // blk))

    def scores(start):
      kb = jnp.concatenate([jax.lax.dynamic_slice_in_dim(c, start, blk, axis=0),
                            jax.lax.dynamic_slice_in_dim(k_r, start, blk, axis=0)], axis=-1)
      return jnp.einsum("qd,nd->qn", q, kb, preferred_element_type=_F32) * scale, kb[:, :d_c]

    def update(carry, s, cb, seen):
      m, l, acc = carry
      if seen is not None:
        s = jnp.where(seen, s, _NEG)
      m_new = jnp.maximum(m, s.max(-1))
      e = jnp.exp(s - m_new[:, None])
      if seen is not None:
        e = jnp.where(seen, e, 0.0)
      corr = jnp.exp(m - m_new)
      acc = acc * corr[:, None] + jnp.einsum("qn,nc->qc", e.astype(cb.dtype), cb,
                                             preferred_element_type=_F32)
      return m_new, l * corr + e.sum(-1), acc

    def full_block(j, carry):
      s, cb = scores(j * blk)
      return update(carry, s, cb, None)

    def edge_block(j, carry):
      # The last block may overhang N: slide it back and mask what earlier blocks covered.
      start = jnp.minimum(j * blk, n - blk)
      s, cb = scores(start)
      k_pos = (start + jnp.arange(blk))[None, :]
      seen = (k_pos >= j * blk) & (k_pos <= q_pos[:, None])                  # [T, blk]
      return update(carry, s, cb, jnp.repeat(seen, h, axis=0))               # [T*H, blk]

    init = (jnp.full((t * h,), _NEG, _F32), jnp.zeros((t * h,), _F32),
            jnp.zeros((t * h, d_c), _F32))
    carry = jax.lax.fori_loop(0, n_full, full_block, init)
    return jax.lax.fori_loop(n_full, n_blocks, edge_block, carry)

  m, l, acc = jax.vmap(row)(q, c, k_r, q_pos, total)
  return m.reshape(b, t, h), l.reshape(b, t, h), acc.reshape(b, t, h, d_c)


def _latent_attention(q_c: jax.Array, q_r: jax.Array, c: jax.Array, k_r: jax.Array,
                      q_pos: jax.Array, total: jax.Array, scale: float, kv_block: int
                      ) -> jax.Array:
  """`latent_attention_partial` normalised: [B, T, H, d_c] float32 sum_j softmax_j c_j."""
  _, l, acc = latent_attention_partial(q_c, q_r, c, k_r, q_pos, total, scale, kv_block)
  return acc / jnp.maximum(l, 1e-30)[..., None]


class MLALayer(nnx.Module):
  """q (optionally via q_lora), latent c = RMSNorm(W_dkv x), k = [W_uk c ; W_kr x], v = W_uv c."""

  def __init__(self, d_model: int, cfg: MLAConfig, *, norm_eps: float,
               compute: ComputeConfig = ComputeConfig(), rngs: nnx.Rngs, context=None,
               interpret: bool = False):
    """context: None, or a context-parallel runner (`parallel.context.ContextParallel`):
    the training forward then attends in the absorbed form over latents gathered across the
    sequence shards (one shared [c ; k_r] head instead of H expanded ones). A runner with
    `shards_cache` (`parallel.context_decode.ContextDecode`) also serves the cached
    forward: its cache stays sharded along N and the runner writes and attends it.
    interpret: tests only: the Pallas cores (compute.mla_impl "triton", "splash") run in
    Pallas' interpreter, on any backend."""
    if cfg.rope_theta and context is not None:
      raise NotImplementedError("model.mla.rope_theta > 0 (RoPE) under context parallelism: "
                                "the context runner does not pass the shards' positions; use "
                                "rope_theta=0 (NoPE, the design) or no context axis")
    self.cfg = cfg
    self.context = context
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

  def absorbed_attention(self, q: jax.Array, cache: "MLACache", q_pos: jax.Array,
                         total: jax.Array, *, kv_block: int) -> jax.Array:
    """Decode attention in the absorbed form, blockwise over the filled part of the cache.

    Args:
      q: [B, T, H, Dn + Dr] queries (compute dtype).
      cache: MLACache holding the keys (the chunk's own latents already written).
      q_pos: [B, T] int32 query positions; key j is visible to a query iff j <= its position.
      total: [B] int32 filled positions per row (bounds the blocks read).
      kv_block: keys per block.
    Returns:
      [B, T, H, Dv] float32.
    """
    dn = self.cfg.qk_nope_head_dim
    w_uk, w_uv = self._up_kernels()
    q_c = jnp.einsum("bthn,chn->bthc", q[..., :dn], w_uk,
                     preferred_element_type=_F32).astype(q.dtype)
    o_c = _latent_attention(q_c, q[..., dn:], cache.c, cache.k_r, q_pos, total,
                            self.cfg.qk_head_dim ** -0.5, kv_block)
    return jnp.einsum("bthc,chv->bthv", o_c.astype(q.dtype), w_uv, preferred_element_type=_F32)

  def expanded_attention(self, q: jax.Array, cache: "MLACache", q_pos: jax.Array
                         ) -> jax.Array:
    """The training form over the whole cache (k_h = [W_uk_h c ; k_r], v_h = W_uv_h c):
    the exact reference of `absorbed_attention` (same arguments but total and kv_block)."""
    w_uk, w_uv = self._up_kernels()
    b, n, _ = cache.c.shape
    h = self.cfg.num_heads
    k = jnp.einsum("bnc,chd->bnhd", cache.c, w_uk)
    k_r = jnp.broadcast_to(cache.k_r[:, :, None, :], (b, n, h, cache.k_r.shape[-1]))
    k = jnp.concatenate([k, k_r.astype(k.dtype)], axis=-1)
    v = jnp.einsum("bnc,chd->bnhd", cache.c, w_uv)
    s = jnp.einsum("bthd,bnhd->bhtn", q, k, preferred_element_type=_F32)
    s = s * self.cfg.qk_head_dim ** -0.5
    visible = jnp.arange(n)[None, None, :] <= q_pos[..., None]              # [B, T, N]
    s = jnp.where(visible[:, None], s, _NEG)
    probs = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhtn,bnhd->bthd", probs.astype(v.dtype), v, preferred_element_type=_F32)

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
    if cfg.rope_theta and k_r is not None:
      pos = (segment_positions(segment_ids, b, t) if cache is None
             else length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
             if length is not None else None)
      if pos is not None:  # (a cache without length fails below)
        dn = cfg.qk_nope_head_dim
        q = jnp.concatenate([q[..., :dn], rope(q[..., dn:], pos, cfg.rope_theta)], axis=-1)
        k_r = rope(k_r, pos, cfg.rope_theta)
    if cache is None and self.context is not None:
      w_uk, w_uv = self._up_kernels()
      dn = cfg.qk_nope_head_dim
      q_c = jnp.einsum("bthn,chn->bthc", q[..., :dn], w_uk,
                       preferred_element_type=_F32).astype(q.dtype)
      k_r = jnp.zeros((b, t, 0), c.dtype) if k_r is None else k_r
      o_c = self.context.latent_attention(jnp.concatenate([q_c, q[..., dn:]], axis=-1), c,
                                          k_r, segment_ids=segment_ids,
                                          scale=cfg.qk_head_dim ** -0.5)
      o = jnp.einsum("bthc,chv->bthv", o_c, w_uv, preferred_element_type=_F32).astype(x.dtype)
    elif cache is None:
      k = self.k_up(c).reshape(b, t, cfg.num_heads, cfg.qk_nope_head_dim)
      if k_r is not None:
        k_r = jnp.broadcast_to(k_r[:, :, None, :], (b, t, cfg.num_heads, cfg.qk_rope_head_dim))
        k = jnp.concatenate([k, k_r], axis=-1)
      v = self.v_up(c).reshape(b, t, cfg.num_heads, cfg.v_head_dim)
      backend, capability = backends.current_backend()
      core, _ = backends.resolve_impl(
          self.impl, backend=backend, seq_len=t, block=self.block, head_dim=cfg.qk_head_dim,
          v_head_dim=cfg.v_head_dim, dtype=self.dtype.name,
          has_segments=segment_ids is not None, compute_capability=capability,
          interpret=self.interpret)
      o = backends.attend(core, q, k, v, segment_ids=segment_ids, scale=cfg.qk_head_dim ** -0.5,
                          block=self.block, interpret=self.interpret)
    else:
      if length is None:
        raise ValueError("MLALayer with a cache needs length: int32 [B] tokens already cached")
      if k_r is None:
        k_r = jnp.zeros((b, t, 0), c.dtype)
      n_valid = (jnp.full((b,), t, jnp.int32) if segment_ids is None
                 else jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32))
      if getattr(self.context, "shards_cache", False):
        # The cache is sharded over the context axis (`parallel.context_decode`): the
        # runner writes the latents and attends shard by shard.
        w_uk, w_uv = self._up_kernels()
        dn = cfg.qk_nope_head_dim
        q_c = jnp.einsum("bthn,chn->bthc", q[..., :dn], w_uk,
                         preferred_element_type=_F32).astype(q.dtype)
        o_c, cache = self.context.cached_latent_attention(
            jnp.concatenate([q_c, q[..., dn:]], axis=-1), c, k_r, cache, n_valid,
            scale=cfg.qk_head_dim ** -0.5, kv_block=kv_block)
        o = jnp.einsum("bthc,chv->bthv", o_c.astype(q.dtype), w_uv,
                       preferred_element_type=_F32).astype(x.dtype)
      else:
        cache = MLACache(_write(cache.c, c, length, n_valid),
                         _write(cache.k_r, k_r, length, n_valid))
        q_pos = length[:, None] + jnp.arange(t)[None, :]
        o = self.absorbed_attention(q, cache, q_pos, length + n_valid, kv_block=kv_block)
        o = o.astype(x.dtype)
    o = o.reshape(b, t, -1)
    if cfg.output_gate:
      o = o * jax.nn.sigmoid(self.gate(x).astype(jnp.float32)).astype(o.dtype)
    return self.o_proj(o), cache
