"""Context parallelism: one sequence sharded over the mesh axis `context` (DESIGN s9b).

Per-shard bodies, called inside `jax.shard_map` with the sequence axis split over
`axis_name` (shard r holds tokens [r T, (r + 1) T) of every row):

- `kda_shard`: KDA's state recurrence is affine in the incoming state. Each shard runs its
  chunks once from the identity to get its map S_out = A S_in + B (A [K, K], B [K, V] per
  row and value head; a segment start inside the shard zeroes A), all-gathers the maps
  (bytes independent of T), folds the earlier shards' maps into its true initial state in
  fp32 (a document that starts at the shard boundary drops it), then runs its local chunked
  pass from that state. Exact; gradients by autodiff through the gather and the fold.
- `latent_attention_shard`: MLA in the absorbed form, one shared latent KV head [c ; k_r].
  The latents are all-gathered over `context` and the local queries attend the gathered
  prefix with the blockwise core (`ops.blockwise_attention`, O(T x block) memory) at the
  shard's offset; key blocks past the shard's last query are never read.
- `previous_tokens`: the last `width` tokens of the previous shard (zeros on shard 0), for
  the short convolutions' left context (a halo exchange with `ppermute`).

`ContextParallel(mesh)` is what a model is built with (`HybridLM(..., context=...)`, like the
MoE dispatch): its `kda` / `latent_attention` take global arrays (batch over data x fsdp,
sequence over `context`) and run the shard bodies in one shard_map each. Everything else in
the model is token-wise and left to XLA's partitioner (the short convolutions included: it
inserts their halo itself).

Conventions as in `ops.kda` / `ops.blockwise_attention`; T here is the local (per-shard)
length, n the number of shards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from hybridmoe_jax.ops.blockwise_attention import blockwise_attention
from hybridmoe_jax.ops.kda import kda
from hybridmoe_jax.sharding import BATCH_AXES

CONTEXT_AXIS = "context"
_HIGHEST = jax.lax.Precision.HIGHEST


def _shard_index_and_count(axis_name: str) -> tuple[jax.Array, int]:
  return jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)


def previous_tokens(x: jax.Array, width: int, axis_name: str = CONTEXT_AXIS) -> jax.Array:
  """x: [B, T, ...] local tokens -> [B, width, ...]: the previous shard's last `width`
  tokens (zeros on shard 0)."""
  n = jax.lax.axis_size(axis_name)
  tail = x[:, x.shape[1] - width:]
  # ppermute leaves shard 0 (no source) with zeros.
  return jax.lax.ppermute(tail, axis_name, [(i, i + 1) for i in range(n - 1)])


def kda_shard(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
              segment_ids: jax.Array | None = None, axis_name: str = CONTEXT_AXIS,
              scale: float | None = None, chunk_size: int = 64,
              lower_bound: float | None = None, impl: str = "chunked") -> jax.Array:
  """One shard of a context-parallel KDA (call inside shard_map over `axis_name`).

  Args:
    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]: this shard's
      tokens (as `ops.kda.kda`).
    segment_ids: [B, T] int32 packed document ids of this shard's tokens (documents may
      cross shard boundaries: the state carries over iff the id continues).
  Returns:
    o: [B, T, HV, V] in v's dtype, equal to the single-device kda over the whole sequence.
  """
  b, t, hv, kd = g.shape
  r, n = _shard_index_and_count(axis_name)
  common = dict(scale=scale, segment_ids=segment_ids, chunk_size=chunk_size,
                lower_bound=lower_bound, impl=impl)
  # The affine map of this shard in one pass: values [0 | v] from the state [I | 0] end as
  # [A | B] (A = the state's linear part, B = what the shard writes from zero).
  v_ext = jnp.concatenate([jnp.zeros((b, t, hv, kd), v.dtype), v], axis=-1)
  eye = jnp.broadcast_to(jnp.eye(kd, dtype=jnp.float32), (b, hv, kd, kd))
  s0 = jnp.concatenate([eye, jnp.zeros((b, hv, kd, v.shape[-1]), jnp.float32)], axis=-1)
  _, maps = kda(q, k, v_ext, g, beta, initial_state=s0, output_final_state=True, **common)
  maps_all = jax.lax.all_gather(maps, axis_name)                    # [n, B, HV, K, K + V]
  if segment_ids is None:
    starts = jnp.zeros((n, b), bool)
  else:  # shard i begins a new document iff its first id differs from shard i-1's last
    ends = jax.lax.all_gather(jnp.stack([segment_ids[:, 0], segment_ids[:, -1]]), axis_name)
    starts = jnp.concatenate([jnp.zeros((1, b), bool), ends[1:, 0] != ends[:-1, 1]])

  def fold(state, i):
    a, bm = maps_all[i, ..., :kd], maps_all[i, ..., kd:]
    out = jnp.einsum("bhkj,bhjv->bhkv", a, state, precision=_HIGHEST) + bm
    out = jnp.where(starts[jnp.minimum(i + 1, n - 1)][:, None, None, None], 0.0, out)
    return jnp.where(i < r, out, state), None

  state, _ = jax.lax.scan(fold, jnp.zeros((b, hv, kd, v.shape[-1]), jnp.float32),
                          jnp.arange(n))
  o, _ = kda(q, k, v, g, beta, initial_state=state, **common)
  return o


def latent_attention_shard(q: jax.Array, c: jax.Array, k_r: jax.Array, *,
                           segment_ids: jax.Array | None = None,
                           axis_name: str = CONTEXT_AXIS, scale: float, block: int = 128
                           ) -> jax.Array:
  """One shard of context-parallel absorbed MLA attention (inside shard_map).

  Args:
    q: [B, T, H, d_c + Dr] absorbed queries ([W_uk q_nope ; q_rope]).
    c: [B, T, d_c] this shard's latents (keys and values); k_r: [B, T, Dr] rope-slot keys.
    segment_ids: [B, T] int32 packed document ids of this shard's tokens.
    scale: logit scale (1 / sqrt(Dn + Dr) of the expanded form).
  Returns:
    [B, T, H, d_c] float32-accumulated sum_j softmax_j c_j in c's dtype (apply W_uv after).
  """
  r = jax.lax.axis_index(axis_name)
  t = c.shape[1]
  keys = jnp.concatenate([c, k_r.astype(c.dtype)], axis=-1)
  keys_all = jax.lax.all_gather(keys, axis_name, axis=1, tiled=True)   # [B, n T, d_c + Dr]
  values_all = keys_all[..., :c.shape[-1]]
  seg = segment_ids if segment_ids is not None else jnp.zeros(c.shape[:2], jnp.int32)
  seg_all = jax.lax.all_gather(seg, axis_name, axis=1, tiled=True)
  return blockwise_attention(q, keys_all[:, :, None], values_all[:, :, None],
                             q_segment_ids=seg, kv_segment_ids=seg_all, q_offset=r * t,
                             scale=scale, block_q=block, block_kv=block)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """The sequence-sharded mixers of a model on `mesh` (axis `context`, size > 1).

  Global arrays come in laid out [B over (data, fsdp), T over context, ...]; each method is
  one shard_map over that layout.
  """

  mesh: Mesh
  block: int = 128          # tokens per block of the MLA attention

  @property
  def size(self) -> int:
    return self.mesh.shape[CONTEXT_AXIS]

  def _map(self, body, n_args: int):
    spec = P(BATCH_AXES, CONTEXT_AXIS)
    return jax.shard_map(body, mesh=self.mesh, in_specs=(spec,) * n_args, out_specs=spec,
                         check_vma=False)

  def _segments(self, segment_ids, shape):
    return jnp.zeros(shape, jnp.int32) if segment_ids is None else segment_ids

  def kda(self, q, k, v, g, beta, *, segment_ids=None, **opts) -> jax.Array:
    """`ops.kda.kda(...)[0]` over the whole sequence (opts: scale, chunk_size, lower_bound,
    impl), computed shard by shard (`kda_shard`)."""
    seg = self._segments(segment_ids, q.shape[:2])
    body = lambda q, k, v, g, b, s: kda_shard(q, k, v, g, b, segment_ids=s, **opts)
    return self._map(body, 6)(q, k, v, g, beta, seg)

  def latent_attention(self, q, c, k_r, *, segment_ids=None, scale: float) -> jax.Array:
    """Absorbed MLA attention over the whole sequence (`latent_attention_shard`)."""
    seg = self._segments(segment_ids, c.shape[:2])
    body = lambda q, c, k_r, s: latent_attention_shard(q, c, k_r, segment_ids=s, scale=scale,
                                                       block=self.block)
    return self._map(body, 4)(q, c, k_r, seg)
