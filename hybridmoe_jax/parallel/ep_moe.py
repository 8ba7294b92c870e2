"""Expert-parallel MoE dispatch inside `jax.shard_map` over the mesh axis `expert` (DESIGN s4.3).

Conventions (per shard): m local tokens, k experts per token, a = m k assignments, E experts,
G = size of `expert`, E_l = E / G experts owned by each shard (shard g owns experts
[g E_l, (g + 1) E_l)), n = expert input width, I = expert width, R = receive-buffer rows.
Tokens are split over (data, fsdp, expert); expert weights over `expert` only.

One step:
  1. sort the a assignments by expert (stable), so the rows for shard j are contiguous;
  2. all_gather the per-expert counts [G, E] (tiny) -> every shard knows every offset;
  3. ragged all-to-all of the sorted rows (`parallel.exchange`, sender-side offsets);
  4. regroup the received rows by local expert, `ragged_dot` gate/up, GLU (fp32), down;
  5. reverse ragged all-to-all to the senders' sorted positions, unsort, combine in fp32.
Buffer sizing: dropless by default (R = G a, the worst case: every shard routes all its
tokens to one shard). With `capacity_factor` c > 0, R = ceil(c a): rows beyond R at a receiver
(the tail of its buffer, i.e. the last senders' last experts) are dropped, contribute zero,
and are counted (valid tokens only) in the "dropped" statistic.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hybridmoe_jax.ops.quantile_balance import qb_histogram
from hybridmoe_jax.ops.routing import expert_load
from hybridmoe_jax.parallel.exchange import ExchangeImpl, ragged_all_to_all
from hybridmoe_jax.sharding import TOKEN_AXES

_F32 = jnp.float32
EXPERT_AXIS = "expert"


def use_expert_parallel(mesh) -> bool:
  """True inside a multi-device mesh context that has an `expert` axis."""
  return (mesh is not None and not mesh.empty and mesh.size > 1
          and EXPERT_AXIS in mesh.axis_names)


def token_axes(mesh) -> tuple[str, ...]:
  return tuple(a for a in TOKEN_AXES if a in mesh.axis_names)


def buffer_rows(assignments: int, num_shards: int, capacity_factor: float) -> int:
  """R: worst case G a when capacity_factor == 0 (dropless), else min(G a, ceil(c a))."""
  worst = num_shards * assignments
  if capacity_factor <= 0:
    return worst
  return max(1, min(worst, math.ceil(capacity_factor * assignments)))


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


def exchange_plan(counts: jax.Array, me, capacity_rows: int) -> dict[str, jax.Array]:
  """Every offset and size of both exchanges, from the gathered counts (pure, no collectives).

  Args:
    counts: [G, E] int32, counts[i, e] = assignments shard i sends to expert e.
    me: this shard's index on the expert axis (int32 scalar).
    capacity_rows: R, rows of each receive buffer (static).

  Returns (all int32):
    send_offsets [G], send_sizes [G], dest_offsets [G]: forward exchange of shard `me`
      (where its chunk for j starts in its sorted rows, how many rows survive the buffer,
      where they land in j's buffer: after the rows of shards 0..me-1);
    recv_sizes [G]: rows `me` receives from each shard;
    recv_offsets [G]: where they start in `me`'s buffer;
    back_dest [G]: for the reverse exchange, where shard i's rows go back to (= shard i's
      send offset for `me`);
    back_recv [G]: rows returned to `me` by each shard (= send_sizes);
    group_ends [G E_l]: inclusive end of each (sender, local expert) run in `me`'s buffer.
  """
  g, e = counts.shape
  e_local = e // g
  per_dest = counts.reshape(g, g, e_local).sum(-1)           # [sender, dest]
  offsets_in = _exclusive_cumsum(per_dest, axis=1)           # sender's sorted-row offsets
  start = _exclusive_cumsum(per_dest, axis=0)                # position in the dest buffer
  eff = jnp.clip(capacity_rows - start, 0, per_dest)         # rows that fit
  mine = jax.lax.dynamic_slice_in_dim(counts, me * e_local, e_local, axis=1)  # [G, E_l]
  group_ends = jnp.cumsum(mine.reshape(-1))
  return {
      "send_offsets": offsets_in[me], "send_sizes": eff[me], "dest_offsets": start[me],
      "recv_sizes": eff[:, me], "recv_offsets": start[:, me], "back_dest": offsets_in[:, me],
      "back_recv": eff[me], "group_ends": group_ends,
  }


def expert_parallel_shard(x, experts, weights, valid, w_gate, w_up, w_down, *,
                          glu: Callable, dtype, num_experts: int, num_shards: int,
                          capacity_factor: float, impl: ExchangeImpl = "auto",
                          axis_name: str = EXPERT_AXIS):
  """The per-shard body (call inside shard_map; `axis_name` of size `num_shards`).

  Args:
    x: [m, n] local tokens (compute dtype); experts [m, k] int32 global expert ids;
    weights: [m, k] fp32; valid: [m] bool (counted in "dropped" only when True);
    w_gate, w_up: [E_l, n, I], w_down: [E_l, I, n] this shard's experts.

  Returns:
    y [m, n] fp32 = sum_k weights * Expert(x) over the assignments that were not dropped;
    dropped: int32 [] valid assignments of this shard's tokens that were dropped.
  """
  m, k = experts.shape
  a = m * k
  e_local = num_experts // num_shards
  rows_cap = buffer_rows(a, num_shards, capacity_factor)
  me = jax.lax.axis_index(axis_name)
  flat = experts.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True)                      # sorted row -> assignment
  xs = jnp.take(x, order // k, axis=0).astype(dtype)          # [a, n] grouped by expert
  counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
  plan = exchange_plan(jax.lax.all_gather(counts, axis_name), me, rows_cap)
  n = x.shape[-1]
  recv = ragged_all_to_all(xs, jnp.zeros((rows_cap, n), dtype), plan["send_offsets"],
                           plan["send_sizes"], plan["dest_offsets"], plan["recv_sizes"],
                           axis_name=axis_name, num_shards=num_shards, impl=impl)
  # Received rows come sender by sender, each sender's rows by local expert: find each row's
  # (sender, expert) run, then regroup by expert; rows past the filled part go last.
  pos = jnp.arange(rows_cap, dtype=jnp.int32)
  run = jnp.searchsorted(plan["group_ends"], pos, side="right")
  filled = pos < jnp.minimum(plan["group_ends"][-1], rows_cap)
  local_e = jnp.where(filled, run % e_local, e_local)
  regroup = jnp.argsort(local_e, stable=True)
  sizes = jnp.zeros((e_local + 1,), jnp.int32).at[local_e].add(1)[:e_local]
  hs = jnp.take(recv, regroup, axis=0)
  dot = lambda u, w: jax.lax.ragged_dot(u.astype(dtype), w.astype(dtype), sizes,
                                        preferred_element_type=_F32)
  h = glu(dot(hs, w_gate), dot(hs, w_up))
  ys = dot(h, w_down)                                         # [R, n] fp32, by expert
  back = jnp.zeros_like(ys).at[regroup].set(ys, unique_indices=True).astype(dtype)
  ret = ragged_all_to_all(back, jnp.zeros((a, n), dtype), plan["recv_offsets"],
                          plan["recv_sizes"], plan["back_dest"], plan["back_recv"],
                          axis_name=axis_name, num_shards=num_shards, impl=impl)
  y = jnp.zeros((a, n), _F32).at[order].set(ret.astype(_F32), unique_indices=True)
  y = jnp.einsum("mk,mkn->mn", weights.astype(_F32), y.reshape(m, k, n))
  # Sorted row r (going to shard d) survived iff it lies in the first send_sizes[d] rows.
  dest = jnp.take(flat, order) // e_local
  r = jnp.arange(a, dtype=jnp.int32)
  kept = r < jnp.take(plan["send_offsets"] + plan["send_sizes"], dest)
  valid_rows = jnp.take(jnp.repeat(valid, k), order)
  dropped = jnp.sum((~kept & valid_rows).astype(jnp.int32))
  return y, dropped


def expert_parallel_ffn(x, experts, weights, valid, w_gate, w_up, w_down, *, glu, dtype,
                        capacity_factor: float = 0.0, impl: ExchangeImpl = "auto"):
  """Routed-expert FFN over the context mesh (`jax.set_mesh`): shard_map over `expert`.

  Args:
    x: [m, n] all tokens (global view); experts [m, k] int32; weights [m, k] fp32;
    valid: [m] bool; w_gate, w_up [E, n, I]; w_down [E, I, n] (global views).

  Returns:
    y [m, n] fp32; dropped: int32 [] valid assignments dropped over the whole batch
    (always 0 when capacity_factor == 0).
  """
  mesh = jax.sharding.get_abstract_mesh()
  toks = token_axes(mesh)
  num_shards = mesh.shape[EXPERT_AXIS]
  num_experts = w_gate.shape[0]

  def body(x, experts, weights, valid, w_gate, w_up, w_down):
    y, dropped = expert_parallel_shard(
        x, experts, weights, valid, w_gate, w_up, w_down, glu=glu, dtype=dtype,
        num_experts=num_experts, num_shards=num_shards, capacity_factor=capacity_factor,
        impl=impl)
    return y, jax.lax.psum(dropped, toks)

  tok, wspec = P(toks), P(EXPERT_AXIS)
  return jax.shard_map(body, in_specs=(tok, tok, tok, tok, wspec, wspec, wspec),
                       out_specs=(tok, P()), check_vma=False)(
                           x, experts, weights, valid, w_gate, w_up, w_down)


def sharded_routing_stats(experts, scores, cutoff, bias, valid, *, num_experts: int, k: int,
                          num_bins: int | None):
  """Load [E] and (if num_bins) QB histogram [E, bins] summed over every token shard.

  Each shard counts its own tokens; one integer psum over (data, fsdp, expert) gives the
  pooled statistics, so the bias update sees the global histogram (exactly the unsharded
  one: integer sums do not depend on the order).
  """
  mesh = jax.sharding.get_abstract_mesh()
  toks = token_axes(mesh)

  def body(experts, scores, cutoff, bias, valid):
    out = {"load": expert_load(experts, num_experts, valid)}
    if num_bins:
      out["qb_hist"] = qb_histogram(scores, bias, k, num_bins, valid, cutoff=cutoff)
    return jax.lax.psum(out, toks)

  tok = P(toks)
  return jax.shard_map(body, in_specs=(tok, tok, tok, P(), tok), out_specs=P(),
                       check_vma=False)(experts, scores, cutoff, bias, valid)
