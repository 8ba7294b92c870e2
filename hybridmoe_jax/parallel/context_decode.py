"""Prefill and decode with the sequence sharded over the mesh axis `context` (DESIGN s9b).

For a prompt longer than one device holds: the MLA latent cache stays split along its length
N over `context` (each device O(T / n) of it); the KDA states are constant in T and
replicated. `ContextDecode(mesh)` is the runner the model's ops call under its execution
plan (`ContextDecode.placement`, which `infer.context_engine.ContextParallelEngine` enters);
n = shards.

Cache layout (`ShardedMLACache`): shard r holds local slots [0, N_loc) of every row, and
`filled [B, n]` (replicated) counts the slots in use on each shard, always a prefix. MLA has
no positional encoding, so only which slots are in use matters, not their order.
- Prefill (T > 1 tokens over `context`, into an EMPTY cache): shard r writes its T / n
  prompt latents to slots [0, T / n), real ones first (padding ends the prompt), so
  filled[b, r] = clip(len_b - r T / n, 0, T / n). Attention is a ring: the [c ; k_r] blocks
  travel round the shards (n - 1 ppermutes), each query block merging the fp32 partials
  (max, sum, output) of the blocks at or before it: no device holds more than two shards'
  latents. KDA (`kda_continue_shard`): each shard's affine map (A, B) from one chunked
  pass, all-gathered and folded from the cache's state into each shard's initial state and
  the final state (the same on every shard).
- Decode (one token per row, replicated): the new latent goes to the first least filled
  shard (the prompt's padding slots fill first, then round-robin), at slot filled[b, r].
  Each shard attends its filled slots (`latent_attention_partial`); one pmax and two psums
  over `context` merge the partials: bytes depend on B, H and d_c, never on T.
Capacity: n * N_loc tokens per row, all usable.

The short convolutions and token-wise projections are left to XLA's partitioner (the conv
tails, W-1 tokens, are gathered from wherever they live). The MoE routes and runs its local
experts on each device's own prompt tokens (`ContextParallel.tokenwise`), so no whole-prompt
array is gathered (measured: BENCHMARKS.md, "Long context").
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar, Iterator, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hybridmoe_jax.config import MLAConfig
from hybridmoe_jax.ops.attention.absorbed import latent_attention_partial
from hybridmoe_jax.ops.attention.reference import NEG_INF
from hybridmoe_jax.ops.kda import kda
from hybridmoe_jax.ops.plan import ExecutionPlan, execution_plan
from hybridmoe_jax.parallel.context import (CONTEXT_AXIS, ContextParallel, affine_maps,
                                            fold_maps)
from hybridmoe_jax.config.sharding import DATA_AXES

_F32 = jnp.float32
_SEQ, _ROWS = P(DATA_AXES, CONTEXT_AXIS), P(DATA_AXES)   # [B, N or T, ...] / [B, ...] arrays


class ShardedMLACache(NamedTuple):
  """One MLA layer's decode cache split along N over `context` (a pytree).

  c: [B, n * N_loc, d_c] and k_r: [B, n * N_loc, Dr] in the compute dtype, sharded
  P(batch, context): shard r holds [B, N_loc, ...]. filled: int32 [B, n] used slots per
  shard (a prefix of each shard's N_loc), replicated.
  """

  c: jax.Array
  k_r: jax.Array
  filled: jax.Array

  @classmethod
  def zeros(cls, cfg: MLAConfig, batch: int, slots_per_shard: int, mesh: Mesh,
            dtype: str) -> "ShardedMLACache":
    """An empty cache of n * slots_per_shard tokens per row, created sharded (never whole
    on one device)."""
    n, dt = mesh.shape[CONTEXT_AXIS], jnp.dtype(dtype)
    seq, rep = NamedSharding(mesh, _SEQ), NamedSharding(mesh, _ROWS)
    make = jax.jit(lambda: cls(jnp.zeros((batch, n * slots_per_shard, cfg.kv_lora_rank), dt),
                               jnp.zeros((batch, n * slots_per_shard, cfg.qk_rope_head_dim), dt),
                               jnp.zeros((batch, n), jnp.int32)),
                   out_shardings=cls(seq, seq, rep))
    return make()


def _merge(a: tuple, b: tuple) -> tuple:
  """Two unnormalised attention partials (m, l, acc) of the same queries -> their union."""
  m = jnp.maximum(a[0], b[0])
  wa, wb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
  return m, a[1] * wa + b[1] * wb, a[2] * wa[..., None] + b[2] * wb[..., None]


def _normalise(part: tuple) -> jax.Array:
  return part[2] / jnp.maximum(part[1], 1e-30)[..., None]


def kda_continue_shard(q, k, v, g, beta, *, initial_state: jax.Array, **opts
                       ) -> tuple[jax.Array, jax.Array]:
  """One shard of a context-parallel KDA continuing from a state (inside shard_map).

  Args:
    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]: this shard's
      tokens (padding: beta = g = 0, which leaves the state unchanged).
    initial_state: [B, HV, K, V] float32, the state before the first shard (replicated).
    opts: scale, chunk_size, lower_bound, impl (as `ops.kda.kda`).
  Returns:
    (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] float32 after the last shard,
    the same on every shard): equal to `kda(..., initial_state, output_final_state=True)`
    over the whole sequence.
  """
  maps = affine_maps(q, k, v, g, beta, **opts)                      # [B, HV, K, K + V]
  maps_all = jax.lax.all_gather(maps, CONTEXT_AXIS)                  # [n, B, HV, K, K + V]
  before, final = fold_maps(maps_all, initial_state.astype(_F32),
                            jax.lax.axis_index(CONTEXT_AXIS)[None])
  o, _ = kda(q, k, v, g, beta, initial_state=before[0], **opts)
  return o, final


def prefill_attention_shard(q: jax.Array, c: jax.Array, k_r: jax.Array, *, scale: float,
                            kv_block: int) -> jax.Array:
  """Causal absorbed attention of a prompt sharded over `context`, as a ring (inside
  shard_map): O(T / n) latents per device, never the whole sequence.

  Args:
    q: [B, T, H, d_c + Dr] this shard's absorbed queries; c: [B, T, d_c]; k_r: [B, T, Dr]
      (shard r holds positions [r T, (r + 1) T); key j is seen by query i iff j <= i, so
      padding at the end of the prompt is never seen by a real token).
  Returns:
    [B, T, H, d_c] float32.
  """
  b, t, h, _ = q.shape
  d_c = c.shape[-1]
  r, n = jax.lax.axis_index(CONTEXT_AXIS), jax.lax.axis_size(CONTEXT_AXIS)
  q_pos = r * t + jnp.arange(t)
  perm = [(i, (i + 1) % n) for i in range(n)]

  def attend(part, c_blk, r_blk, src):
    """Merge the keys of shard `src` (positions src T + j) into the partial."""
    rel = jnp.broadcast_to(q_pos - src * t, (b, t))
    total = jnp.full((b,), jnp.clip((r - src + 1) * t, 0, t), jnp.int32)  # 0: not read
    return _merge(part, latent_attention_partial(q, c_blk, r_blk, rel, total, scale, kv_block))

  def step(s, carry):
    part, c_blk, r_blk = carry
    c_blk, r_blk = jax.lax.ppermute((c_blk, r_blk), CONTEXT_AXIS, perm)  # from shard r - s
    return attend(part, c_blk, r_blk, (r - s) % n), c_blk, r_blk

  empty = (jnp.full((b, t, h), NEG_INF, _F32), jnp.zeros((b, t, h), _F32),  # max, sum, out
           jnp.zeros((b, t, h, d_c), _F32))
  part = attend(empty, c, k_r, r)
  part, _, _ = jax.lax.fori_loop(1, n, step, (part, c, k_r))
  return _normalise(part)


def decode_attention_shard(q: jax.Array, c: jax.Array, k_r: jax.Array,
                           cache: ShardedMLACache, n_valid: jax.Array, *, scale: float,
                           kv_block: int) -> tuple[jax.Array, ShardedMLACache]:
  """One new token per row against a sharded latent cache (inside shard_map).

  Args:
    q: [B, 1, H, d_c + Dr] absorbed queries; c: [B, 1, d_c]; k_r: [B, 1, Dr] (replicated).
    cache: this shard's piece (c [B, N_loc, d_c], k_r [B, N_loc, Dr]) and filled [B, n].
    n_valid: [B] int32, 1 for a real token, 0 for padding (not written).
  Returns:
    ([B, 1, H, d_c] float32 the same on every shard, the cache with the token written on
    the least filled shard).
  """
  b = c.shape[0]
  r, n = jax.lax.axis_index(CONTEXT_AXIS), jax.lax.axis_size(CONTEXT_AXIS)
  n_loc = cache.c.shape[1]
  owner = jnp.argmin(cache.filled, axis=1)                                       # [B]
  slot = jnp.take_along_axis(cache.filled, owner[:, None], axis=1)[:, 0]
  write = (owner == r) & (n_valid > 0)
  idx = jnp.where(write, slot, n_loc)                          # n_loc (out of range): dropped
  rows = jnp.arange(b)
  new_c = cache.c.at[rows, idx].set(c[:, 0].astype(cache.c.dtype), mode="drop")
  new_r = cache.k_r.at[rows, idx].set(k_r[:, 0].astype(cache.k_r.dtype), mode="drop")
  filled = cache.filled + jax.nn.one_hot(owner, n, dtype=jnp.int32) * (n_valid > 0)[:, None]
  local = jax.lax.dynamic_index_in_dim(filled, r, axis=1, keepdims=False)       # [B]
  m, l, acc = latent_attention_partial(q, new_c, new_r, (local - 1)[:, None], local, scale,
                                       kv_block)
  # Log-sum-exp merge over the shards: [B, 1, H] and [B, 1, H, d_c] fp32, whatever T is.
  m_all = jax.lax.pmax(m, CONTEXT_AXIS)
  w = jnp.exp(m - m_all)
  l_all = jax.lax.psum(l * w, CONTEXT_AXIS)
  acc_all = jax.lax.psum(acc * w[..., None], CONTEXT_AXIS)
  return _normalise((m_all, l_all, acc_all)), ShardedMLACache(new_c, new_r, filled)


@dataclasses.dataclass(frozen=True)
class ContextDecode(ContextParallel):
  """`ContextParallel` that also runs the cached forward with a sharded cache.

  A cached chunk of T > 1 tokens is a prompt laid out [B over (data, fsdp), T over context]
  going into an EMPTY cache (`ContextParallelEngine.prefill` guarantees it); a chunk of one
  token is a decode step, replicated over `context`.
  """

  shards_cache: ClassVar[bool] = True   # what the ops' cached dispatch looks for (`ops.plan`)

  @contextlib.contextmanager
  def placement(self) -> Iterator[None]:
    """The mesh and the plan with this runner, entered together around every traced call
    (the mesh is part of jit's key: these programs never mix with local ones)."""
    with jax.set_mesh(self.mesh), execution_plan(ExecutionPlan(context=self)):
      yield

  def kda_continue(self, q, k, v, g, beta, *, initial_state, **opts
                   ) -> tuple[jax.Array, jax.Array]:
    """`ops.kda.kda(..., initial_state, output_final_state=True)` over the whole sharded
    sequence (`kda_continue_shard`); the final state [B, HV, K, V] fp32 replicated."""
    body = lambda q, k, v, g, b, s: kda_continue_shard(q, k, v, g, b, initial_state=s, **opts)
    return jax.shard_map(body, mesh=self.mesh, in_specs=(_SEQ,) * 5 + (_ROWS,),
                         out_specs=(_SEQ, _ROWS), check_vma=False)(q, k, v, g, beta,
                                                                   initial_state)

  def cached_latent_attention(self, q: jax.Array, c: jax.Array, k_r: jax.Array,
                              cache: ShardedMLACache, n_valid: jax.Array, *, scale: float,
                              kv_block: int) -> tuple[jax.Array, ShardedMLACache]:
    """Absorbed MLA over a sharded cache: write the chunk's latents, attend.

    Args:
      q: [B, T, H, d_c + Dr] absorbed queries; c: [B, T, d_c], k_r: [B, T, Dr] the chunk's
        latents; n_valid: [B] int32 real tokens per row (a prefix of the chunk).
      cache: a ShardedMLACache (empty when T > 1).
    Returns:
      ([B, T, H, d_c] float32, the updated cache).
    """
    if not isinstance(cache, ShardedMLACache):
      raise ValueError(f"ContextDecode needs ShardedMLACache layers in the cache, got "
                       f"{type(cache).__name__} (build it with ContextParallelEngine)")
    n, t = self.size, q.shape[1]
    cache_spec = ShardedMLACache(_SEQ, _SEQ, _ROWS)
    if t == 1:
      body = lambda q, c, k_r, cache, nv: decode_attention_shard(
          q, c, k_r, cache, nv, scale=scale, kv_block=kv_block)
      return jax.shard_map(body, mesh=self.mesh, in_specs=(_ROWS,) * 3 + (cache_spec, _ROWS),
                           out_specs=(_ROWS, cache_spec), check_vma=False)(q, c, k_r, cache,
                                                                           n_valid)
    if t % n:
      raise ValueError(f"a context-parallel prompt chunk must hold a multiple of "
                       f"mesh.context={n} tokens, got {t} (pad it)")
    t_loc, n_loc = t // n, cache.c.shape[1] // n
    if t_loc > n_loc:
      raise ValueError(f"a prompt of {t} tokens needs {t_loc} slots per shard, the cache has "
                       f"{n_loc} (raise max_len)")

    def body(q, c, k_r, cache_c, cache_r):
      o = prefill_attention_shard(q, c, k_r, scale=scale, kv_block=kv_block)
      cache_c = jax.lax.dynamic_update_slice_in_dim(cache_c, c.astype(cache_c.dtype), 0, 1)
      cache_r = jax.lax.dynamic_update_slice_in_dim(cache_r, k_r.astype(cache_r.dtype), 0, 1)
      return o, cache_c, cache_r

    o, new_c, new_r = jax.shard_map(body, mesh=self.mesh, in_specs=(_SEQ,) * 5,
                                    out_specs=(_SEQ,) * 3, check_vma=False)(
                                        q, c, k_r, cache.c, cache.k_r)
    filled = jnp.clip(n_valid[:, None] - jnp.arange(n)[None, :] * t_loc, 0, t_loc)
    return o, ShardedMLACache(new_c, new_r, filled.astype(jnp.int32))
