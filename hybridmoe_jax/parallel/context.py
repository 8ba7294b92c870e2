"""Context parallelism: one sequence sharded over the mesh axis `context` (DESIGN s9b has
the algorithms: KDA's affine state fold, the MLA latent gather, the zigzag layout).

Layouts (`piece_table(n, zigzag)`): contiguous, shard r holds piece r of n; zigzag, 2n
pieces of T / 2 tokens, shard r holds pieces r and 2n-1-r (equal causal attention work).
`HybridLM` moves its per-token inputs into the layout (`ContextParallel.to_layout`, ppermutes
of each shard's own tokens, never a gather) and its last hidden state back (`from_layout`).

Per-shard bodies, called inside `jax.shard_map` (T here is the local length): `kda_shard`
(per-piece state maps all-gathered and folded in fp32, then each piece's chunked pass; exact,
gradients by autodiff), `latent_attention_shard` (the gathered latents attended blockwise at
each piece's offset), `previous_tokens` / `short_conv_shard` (the convolutions' explicit left
halo by ppermute; XLA's automatic halo reads the wrong neighbours under zigzag), and for the
MoE `flatten_tokens` / `tokenwise` (XLA does not partition top_k or the expert sort along
tokens, so each device's block is flattened in place and routed locally, stats psum-ed).

`ContextParallel(mesh, block, zigzag)` is the `context` of an execution plan (`ops.plan`):
its methods take global arrays (batch over data x fsdp, sequence over `context`, in the
layout) and run the shard bodies in one shard_map each.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from hybridmoe_jax.ops.conv import short_conv
from hybridmoe_jax.ops.attention.blockwise import blockwise_attention
from hybridmoe_jax.ops.kda import kda
from hybridmoe_jax.config.sharding import DATA_AXES, batch_axes

CONTEXT_AXIS = "context"
_HIGHEST = jax.lax.Precision.HIGHEST


@functools.lru_cache(maxsize=None)
def piece_table(n: int, zigzag: bool) -> np.ndarray:
  """[n, m] int: the sequence piece held in slot j of shard r (m = 2 with zigzag, else 1)."""
  r = np.arange(n)
  table = np.stack([r, 2 * n - 1 - r], axis=1) if zigzag else r[:, None]
  table.setflags(write=False)
  return table


def _location(table: np.ndarray, piece: int) -> tuple[int, int]:
  shard, slot = np.argwhere(table == piece)[0]
  return int(shard), int(slot)


def _route(parts: jax.Array, sources) -> jax.Array:
  """Move pieces between shards: parts [B, m_in, ...] local -> [B, m_out, ...] where slot j
  of shard d is parts[:, i] of shard s for sources[d][j] = (s, i), zeros for None.

  One ppermute per (i, j) slot pair that crosses shards (each shard sends and receives one
  piece per ppermute: the bytes of the pieces moved, no gather); same-shard moves are local.
  A received zero is added where nothing arrives, so the sum is exact.
  """
  n, m_out = len(sources), len(sources[0])
  r = jax.lax.axis_index(CONTEXT_AXIS)
  out = []
  for j in range(m_out):
    acc = jnp.zeros_like(parts[:, 0])
    for i in range(parts.shape[1]):
      pairs = [(sources[d][j][0], d) for d in range(n)
               if sources[d][j] is not None and sources[d][j][1] == i and sources[d][j][0] != d]
      if pairs:
        acc = acc + jax.lax.ppermute(parts[:, i], CONTEXT_AXIS, pairs)
      local = [d for d in range(n) if sources[d][j] == (d, i)]
      if local:
        acc = acc + jnp.where(jnp.isin(r, jnp.asarray(local)), parts[:, i], 0)
    out.append(acc)
  return jnp.stack(out, axis=1)


def _split(x: jax.Array, m: int) -> jax.Array:
  """[B, T, ...] -> [B, m, T / m, ...]."""
  return x.reshape(x.shape[0], m, x.shape[1] // m, *x.shape[2:])


def _flat(x: jax.Array) -> jax.Array:
  """[B, m, ...] -> [B m, ...] (row-major: row b, piece j at b m + j)."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _check_pieces(t: int, m: int, what: str, at_least: int = 1) -> None:
  if t % m or t // m < at_least:
    raise ValueError(f"{what}: {t} local tokens do not split into {m} pieces of >= "
                     f"{at_least} tokens (zigzag needs the sequence to be a multiple of "
                     f"2 x mesh.context)")


def previous_tokens(x: jax.Array, width: int, *, zigzag: bool = False) -> jax.Array:
  """x: [B, T, ...] local tokens -> [B, m, width, ...]: for each local piece, the last
  `width` tokens of the piece before it in sequence order (zeros for the first piece)."""
  n = jax.lax.axis_size(CONTEXT_AXIS)
  table = piece_table(n, zigzag)
  m = table.shape[1]
  _check_pieces(x.shape[1], m, "previous_tokens", width)
  tails = _split(x, m)[:, :, -width:]
  sources = [[None if table[d, j] == 0 else _location(table, table[d, j] - 1)
              for j in range(m)] for d in range(n)]
  return _route(tails, sources)


def short_conv_shard(x: jax.Array, w: jax.Array, *, segment_ids: jax.Array | None = None,
                     zigzag: bool = False) -> jax.Array:
  """One shard of the short convolution (inside shard_map): x [B, T, C] local tokens,
  w [W, C] fp32, segment_ids [B, T] int32 or None -> [B, T, C] in x's dtype, equal to
  `ops.conv.short_conv` over the whole sequence (taps never cross a change of id)."""
  m = piece_table(jax.lax.axis_size(CONTEXT_AXIS), zigzag).shape[1]
  lag = w.shape[0] - 1
  if lag == 0:
    return short_conv(x, w, segment_ids=segment_ids)
  halo = previous_tokens(x, lag, zigzag=zigzag)                             # [B, m, W-1, C]
  opts = {}
  if segment_ids is not None:
    halo_ids = previous_tokens(segment_ids, lag, zigzag=zigzag)             # first: 0s
    opts = dict(segment_ids=_flat(_split(segment_ids, m)), history_ids=_flat(halo_ids))
  y = short_conv(_flat(_split(x, m)), w, history=_flat(halo), **opts)
  return y.reshape(x.shape)


def affine_maps(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                **opts) -> jax.Array:
  """Each row's KDA state map S_out = A S_in + B over its tokens, in one pass: values
  [0 | v] from the state [I | 0] end as [A | B] (A the state's linear part, B what the
  tokens write from zero). Shapes as `ops.kda.kda` (opts: its keywords); returns
  [B, HV, K, K + V] float32."""
  b, _, hv, kd = g.shape
  v_ext = jnp.concatenate([jnp.zeros(g.shape, v.dtype), v], axis=-1)
  eye = jnp.broadcast_to(jnp.eye(kd, dtype=jnp.float32), (b, hv, kd, kd))
  s0 = jnp.concatenate([eye, jnp.zeros((b, hv, kd, v.shape[-1]), jnp.float32)], axis=-1)
  _, maps = kda(q, k, v_ext, g, beta, initial_state=s0, output_final_state=True, **opts)
  return maps


def fold_maps(maps: jax.Array, state: jax.Array, wanted: jax.Array,
              restart: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The pieces' state maps [P, B, HV, K, K + V] (`affine_maps`, in sequence order) applied
  one after the other from `state` [B, HV, K, V] float32, at HIGHEST precision.

  wanted: [m] int pieces; restart: [P, B] bool or None, True where the state after piece p
  is zero (piece p + 1 begins a new document). Returns (the states entering the `wanted`
  pieces [m, B, HV, K, V], the state after the last piece), float32.
  """
  kd = maps.shape[-2]

  def fold(carry, p):
    state, picked = carry   # state entering piece p; picked [m, ...]: the wanted ones
    picked = jnp.where((wanted == p)[:, None, None, None, None], state[None], picked)
    out = jnp.einsum("bhkj,bhjv->bhkv", maps[p, ..., :kd], state, precision=_HIGHEST)
    out = out + maps[p, ..., kd:]
    if restart is not None:
      out = jnp.where(restart[p][:, None, None, None], 0.0, out)
    return (out, picked), None

  picked = jnp.zeros(wanted.shape + state.shape, jnp.float32)
  (state, picked), _ = jax.lax.scan(fold, (state, picked), jnp.arange(maps.shape[0]))
  return picked, state


def kda_shard(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
              segment_ids: jax.Array | None = None, zigzag: bool = False,
              scale: float | None = None, chunk_size: int = 64,
              lower_bound: float | None = None, impl: str = "chunked") -> jax.Array:
  """One shard of a context-parallel KDA (call inside shard_map over `context`).

  Args:
    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]: this shard's
      tokens in the layout of `piece_table(n, zigzag)` (as `ops.kda.kda`).
    segment_ids: [B, T] int32 packed document ids of this shard's tokens (documents may
      cross piece boundaries: the state carries over iff the id continues).
  Returns:
    o: [B, T, HV, V] in v's dtype, equal to the single-device kda over the whole sequence.
  """
  b, t, hv, kd = g.shape
  r, n = jax.lax.axis_index(CONTEXT_AXIS), jax.lax.axis_size(CONTEXT_AXIS)
  table = piece_table(n, zigzag)
  m = table.shape[1]
  _check_pieces(t, m, "kda_shard")
  pieces = lambda x: _flat(_split(x, m))                 # [B m, T / m, ...]
  q, k, v, g, beta = map(pieces, (q, k, v, g, beta))
  seg = None if segment_ids is None else pieces(segment_ids)
  common = dict(scale=scale, segment_ids=seg, chunk_size=chunk_size, lower_bound=lower_bound,
                impl=impl)
  maps = affine_maps(q, k, v, g, beta, **common)                   # [B m, HV, K, K + V]
  # Gathered [n, m, ...] (shard, slot) -> [n m, ...] in sequence order.
  order = np.argsort(table.reshape(-1))
  in_sequence = lambda x: x.reshape(n * m, *x.shape[2:])[order]
  maps = maps.reshape(b, m, *maps.shape[1:]).swapaxes(0, 1)
  maps_all = in_sequence(jax.lax.all_gather(maps, CONTEXT_AXIS))   # [n m, B, HV, K, K + V]
  restart = None
  if seg is not None:  # piece p + 1 begins a new document iff its first id differs from p's last
    ends = jnp.stack([seg[:, 0], seg[:, -1]]).reshape(2, b, m).transpose(2, 0, 1)
    ends = in_sequence(jax.lax.all_gather(ends, CONTEXT_AXIS))     # [n m, 2, B]
    # (after the last piece: False, its state is not used)
    restart = jnp.concatenate([ends[1:, 0] != ends[:-1, 1], jnp.zeros((1, b), bool)])
  zero = jnp.zeros((b, hv, kd, v.shape[-1]), jnp.float32)
  picked, _ = fold_maps(maps_all, zero, jnp.asarray(table)[r], restart)  # my pieces' states
  state = _flat(picked.swapaxes(0, 1))                               # [B m, HV, K, V]
  o, _ = kda(q, k, v, g, beta, initial_state=state, **common)
  return o.reshape(b, t, *o.shape[2:])


def latent_attention_shard(q: jax.Array, c: jax.Array, k_r: jax.Array, *,
                           segment_ids: jax.Array | None = None, zigzag: bool = False,
                           scale: float, block: int = 128) -> jax.Array:
  """One shard of context-parallel absorbed MLA attention (inside shard_map).

  Args:
    q: [B, T, H, d_c + Dr] absorbed queries ([W_uk q_nope ; q_rope]), in the layout of
      `piece_table(n, zigzag)`.
    c: [B, T, d_c] this shard's latents (keys and values); k_r: [B, T, Dr] rope-slot keys.
    segment_ids: [B, T] int32 packed document ids of this shard's tokens.
    scale: logit scale (1 / sqrt(Dn + Dr) of the expanded form).
  Returns:
    [B, T, H, d_c] float32-accumulated sum_j softmax_j c_j in c's dtype (apply W_uv after).
  """
  r, n = jax.lax.axis_index(CONTEXT_AXIS), jax.lax.axis_size(CONTEXT_AXIS)
  table = piece_table(n, zigzag)
  m = table.shape[1]
  b, t = c.shape[:2]
  _check_pieces(t, m, "latent_attention_shard")
  size = t // m
  order = np.argsort(table.reshape(-1))

  def gathered(x):  # [B, T, ...] local -> [B, n T, ...] all pieces in sequence order
    x_all = jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)
    if m == 1:
      return x_all
    x_all = x_all.reshape(b, n * m, size, *x.shape[2:])[:, order]
    return x_all.reshape(b, n * t, *x.shape[2:])

  keys_all = gathered(jnp.concatenate([c, k_r.astype(c.dtype)], axis=-1))
  values_all = keys_all[..., :c.shape[-1]]
  seg = segment_ids if segment_ids is not None else jnp.zeros((b, t), jnp.int32)
  seg_all = gathered(seg)
  outs = []
  for j in range(m):   # each piece's queries at its own offset: later key blocks unread
    lo = slice(j * size, (j + 1) * size)
    outs.append(blockwise_attention(
        q[:, lo], keys_all[:, :, None], values_all[:, :, None], q_segment_ids=seg[:, lo],
        kv_segment_ids=seg_all, q_offset=jnp.asarray(table[:, j])[r] * size, scale=scale,
        block_q=block, block_kv=block))
  return outs[0] if m == 1 else jnp.concatenate(outs, axis=1)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """The sequence-sharded mixers of a model on `mesh` (axis `context`, size > 1).

  Global arrays come in laid out [B over its batch axes (`batch_axes`: data, fsdp and
  expert where B divides), T over context, ...] in the layout
  (`piece_table(size, zigzag)`); each method is one shard_map over that layout.
  zigzag: 2 pieces per shard (causal load balance); the model moves its inputs into the
  layout with `to_layout` and its output back with `from_layout` (identities without).
  """

  mesh: Mesh
  block: int = 128          # tokens per block of the MLA attention
  zigzag: bool = False

  @property
  def size(self) -> int:
    return self.mesh.shape[CONTEXT_AXIS]

  def _rows(self, b: int) -> P:
    """[B, T, ...] over B's batch axes and T over context."""
    return P(batch_axes(dict(self.mesh.shape), b), CONTEXT_AXIS)

  def _map(self, body, n_args: int, replicated: int = 0, *, rows: int):
    spec = self._rows(rows)
    return jax.shard_map(body, mesh=self.mesh,
                         in_specs=(spec,) * n_args + (P(),) * replicated, out_specs=spec,
                         check_vma=False)

  def _segments(self, segment_ids, shape):
    return jnp.zeros(shape, jnp.int32) if segment_ids is None else segment_ids

  def _move(self, x: jax.Array, src: np.ndarray, dst: np.ndarray) -> jax.Array:
    """Global [B, T, ...]: the 2n pieces from layout `src` to layout `dst` ([n, 2] tables)."""
    sources = [[_location(src, p) for p in row] for row in dst]

    def body(x):
      _check_pieces(x.shape[1], 2, "ContextParallel layout")
      y = _route(_split(x, 2), sources)
      return y.reshape(x.shape)

    return self._map(body, 1, rows=x.shape[0])(x)

  def _natural(self) -> np.ndarray:   # 2n pieces, contiguous: shard r holds 2r, 2r + 1
    return np.arange(2 * self.size).reshape(self.size, 2)

  def to_layout(self, x: jax.Array) -> jax.Array:
    """[B, T, ...] per-token array in sequence order -> the same in the layout (identity
    unless zigzag): one exchange of each shard's own tokens."""
    return self._move(x, self._natural(), piece_table(self.size, True)) if self.zigzag else x

  def from_layout(self, x: jax.Array) -> jax.Array:
    """The inverse of `to_layout`."""
    return self._move(x, piece_table(self.size, True), self._natural()) if self.zigzag else x

  # ---- token-wise work (the MoE): each device's own tokens, never the whole sequence ----
  def token_axes(self, b: int) -> tuple[str, ...]:
    """The mesh axes the tokens of a [B, T] batch are split over: B's batch axes, then
    context."""
    return (*batch_axes(dict(self.mesh.shape), b), CONTEXT_AXIS)

  def splits(self, b: int, t: int) -> bool:
    """Whether a [B, T] batch is laid out over the token axes (B over data x fsdp at least,
    T over context); False e.g. for a decode step (T = 1, replicated over context)."""
    dp = math.prod(self.mesh.shape[a] for a in DATA_AXES if a in self.mesh.axis_names)
    return b % dp == 0 and t % self.size == 0

  def flatten_tokens(self, x: jax.Array) -> jax.Array:
    """[B, T, ...] laid out (B over data x fsdp, T over context) -> [B T, ...] split over
    `token_axes`, device-major: each device flattens its own [B_loc, T_loc] block, no data
    moves. (A plain reshape is not a local op when a device holds several rows: XLA
    re-lays the tokens out, gathering whole sequences.) Token-wise code does not care about
    the order; `unflatten_tokens` undoes it."""
    body = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return jax.shard_map(body, mesh=self.mesh, in_specs=self._rows(x.shape[0]),
                         out_specs=P(self.token_axes(x.shape[0])), check_vma=False)(x)

  def unflatten_tokens(self, y: jax.Array, b: int, t: int) -> jax.Array:
    """The inverse of `flatten_tokens`: [B T, ...] -> [B, T, ...]."""
    dp = math.prod(self.mesh.shape[a] for a in batch_axes(dict(self.mesh.shape), b))
    shape = (b // dp, t // self.size)
    body = lambda y: y.reshape(*shape, *y.shape[1:])
    return jax.shard_map(body, mesh=self.mesh, in_specs=P(self.token_axes(b)),
                         out_specs=self._rows(b), check_vma=False)(y)

  def tokenwise(self, fn, per_token: tuple, shared: tuple = (), *, rows: int):
    """fn on each device's own tokens: one shard_map over `token_axes`.

    Args:
      fn: (*per_token, *shared) -> (per-token pytree, additive pytree), computed token by
        token (e.g. routing: top_k, which XLA does not partition along the tokens and
        would otherwise run on a gathered [B T, E] array) plus sums over the tokens.
      per_token: [m, ...] arrays from `flatten_tokens` (None entries allowed).
      rows: B of the [B, T] batch they were flattened from (their layout).
      shared: arrays every device needs whole (replicated; their gradients are summed
        over the shards).
    Returns:
      (the per-token outputs [m, ...] split over `token_axes`, the additive outputs
      psum-ed over `token_axes`: the whole batch's sums, exact for integers).
    """
    axes = self.token_axes(rows)

    def body(*args):
      out, summed = fn(*args)
      return out, jax.lax.psum(summed, axes)

    tok = P(axes)
    return jax.shard_map(body, mesh=self.mesh,
                         in_specs=(tok,) * len(per_token) + (P(),) * len(shared),
                         out_specs=(tok, P()), check_vma=False)(*per_token, *shared)

  def short_conv(self, x, w, *, segment_ids=None) -> jax.Array:
    """`ops.conv.short_conv(x, w, segment_ids=...)` over the whole sequence, each shard
    reading its left halo explicitly (`short_conv_shard`); w [W, C] is replicated."""
    seg = self._segments(segment_ids, x.shape[:2])
    body = lambda x, s, w: short_conv_shard(x, w, segment_ids=s, zigzag=self.zigzag)
    return self._map(body, 2, replicated=1, rows=x.shape[0])(x, seg, w)

  def kda(self, q, k, v, g, beta, *, segment_ids=None, **opts) -> jax.Array:
    """`ops.kda.kda(...)[0]` over the whole sequence (opts: scale, chunk_size, lower_bound,
    impl), computed shard by shard (`kda_shard`)."""
    seg = self._segments(segment_ids, q.shape[:2])
    body = lambda q, k, v, g, b, s: kda_shard(q, k, v, g, b, segment_ids=s,
                                              zigzag=self.zigzag, **opts)
    return self._map(body, 6, rows=q.shape[0])(q, k, v, g, beta, seg)

  def latent_attention(self, q, c, k_r, *, segment_ids=None, scale: float) -> jax.Array:
    """Absorbed MLA attention over the whole sequence (`latent_attention_shard`)."""
    seg = self._segments(segment_ids, c.shape[:2])
    body = lambda q, c, k_r, s: latent_attention_shard(q, c, k_r, segment_ids=s, scale=scale,
                                                       zigzag=self.zigzag, block=self.block)
    return self._map(body, 4, rows=q.shape[0])(q, c, k_r, seg)
