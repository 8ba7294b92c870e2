"""Expert-parallel MoE dispatch inside `jax.shard_map` over the mesh axis `expert` (DESIGN s4.3).

Conventions (per shard): m local tokens, k experts per token, a = m k assignments, E experts,
G = size of `expert`, E_l = E / G experts owned by each shard (shard g owns experts
[g E_l, (g + 1) E_l)), n = expert input width, I = expert width, R = receive-buffer rows.
Tokens are split over (data, fsdp, expert) (and `context`, see `token_axes`); expert weights
over `expert` only.

One step:
  1. sort the a assignments by expert (stable), so the rows for shard j are contiguous;
  2. all_gather the per-expert counts [G, E] (tiny) -> every shard knows every offset;
  3. ragged all-to-all of the sorted rows (`parallel.exchange`, sender-side offsets);
  4. run the received rows through their local experts (`ops.grouped_ffn`, the sort /
     `ragged_dot` / unsort core the local MoE path uses too);
  5. reverse ragged all-to-all to the senders' sorted positions, unsort, combine in fp32.
Buffer sizing: dropless by default (R = G a, the worst case: every shard routes all its
tokens to one shard). With `capacity_factor` c > 0, R = ceil(c a): rows beyond R at a receiver
(the tail of its buffer, i.e. the last senders' last experts) are dropped, contribute zero,
and are counted (valid tokens only) in the "dropped" statistic.
The MoE layer reaches this through `ExpertParallelDispatch`, built once by the parallel
runtime and passed down the model; the layers never read the ambient mesh.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from hybridmoe_jax.config import MoEConfig
from hybridmoe_jax.layers.balancing import Stats, routing_stats
from hybridmoe_jax.ops.grouped_ffn import grouped_ffn
from hybridmoe_jax.ops.routing import Routes
from hybridmoe_jax.parallel.context import CONTEXT_AXIS
from hybridmoe_jax.parallel.exchange import ExchangeImpl, ragged_all_to_all, resolve_impl
from hybridmoe_jax.config.sharding import DATA_AXES, batch_axes

_F32 = jnp.float32
EXPERT_AXIS = "expert"


def token_axes(mesh, num_tokens: int, rows: int | None = None) -> tuple[str, ...]:
  """The axes the m = `num_tokens` tokens are split over: the layout they arrive in, then
  `expert` as the minor axis when it is not among them (a local slice of each device's
  tokens).

  With `rows` (the m tokens are a flattened [rows, T] batch): its batch axes (`batch_axes`:
  data, fsdp, and expert where rows divide), then `context` when m splits over it (a context
  runner's `flatten_tokens`, or a plain reshape of T over context: leaving it out would
  gather the sequence), then expert. Without: (data, fsdp, context, expert) when m splits
  over it, else (data, fsdp, expert) (a decode step's few rows, replicated over context)."""
  names, shape = mesh.axis_names, dict(mesh.shape)
  size = lambda axes: math.prod(shape[a] for a in axes)
  lay = (batch_axes(shape, rows) if rows is not None
         else tuple(a for a in DATA_AXES if a in names))
  for extra in (CONTEXT_AXIS, EXPERT_AXIS):
    if extra in names and extra not in lay and num_tokens % size((*lay, extra)) == 0:
      lay = (*lay, extra)
  return lay


def buffer_rows(assignments: int, num_shards: int, capacity_factor: float) -> int:
  """R: worst case G a when capacity_factor == 0 (dropless), else min(G a, ceil(c a)).

  c a is exact in c's decimal value (c = 1.1, a = 100: 110 rows; the float product
  110.00000000000001 would round up to 111)."""
  worst = num_shards * assignments
  if capacity_factor <= 0:
    return worst
  exact = fractions.Fraction(repr(float(capacity_factor))) * assignments
  return max(1, min(worst, math.ceil(exact)))


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
                          capacity_factor: float, impl: ExchangeImpl = "auto"):
  """The per-shard body (call inside shard_map; `expert` of size `num_shards`).

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
  me = jax.lax.axis_index(EXPERT_AXIS)
  flat = experts.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True)                      # sorted row -> assignment
  xs = jnp.take(x, order // k, axis=0).astype(dtype)          # [a, n] grouped by expert
  counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
  plan = exchange_plan(jax.lax.all_gather(counts, EXPERT_AXIS), me, rows_cap)
  n = x.shape[-1]
  recv = ragged_all_to_all(xs, jnp.zeros((rows_cap, n), dtype), plan["send_offsets"],
                           plan["send_sizes"], plan["dest_offsets"], plan["recv_sizes"],
                           axis_name=EXPERT_AXIS, num_shards=num_shards, impl=impl)
  # Received rows come sender by sender, each sender's rows by local expert: find each row's
  # (sender, expert) run; rows past the filled part get the skip group e_local.
  pos = jnp.arange(rows_cap, dtype=jnp.int32)
  run = jnp.searchsorted(plan["group_ends"], pos, side="right")
  filled = pos < jnp.minimum(plan["group_ends"][-1], rows_cap)
  local_e = jnp.where(filled, run % e_local, e_local)
  back = grouped_ffn(recv, local_e, w_gate, w_up, w_down, glu=glu, dtype=dtype).astype(dtype)
  ret = ragged_all_to_all(back, jnp.zeros((a, n), dtype), plan["recv_offsets"],
                          plan["recv_sizes"], plan["back_dest"], plan["back_recv"],
                          axis_name=EXPERT_AXIS, num_shards=num_shards, impl=impl)
  y = jnp.zeros((a, n), _F32).at[order].set(ret.astype(_F32), unique_indices=True)
  y = jnp.einsum("mk,mkn->mn", weights.astype(_F32), y.reshape(m, k, n))
  # Sorted row r (going to shard d) survived iff it lies in the first send_sizes[d] rows.
  dest = jnp.take(flat, order) // e_local
  r = jnp.arange(a, dtype=jnp.int32)
  kept = r < jnp.take(plan["send_offsets"] + plan["send_sizes"], dest)
  valid_rows = jnp.take(jnp.repeat(valid, k), order)
  dropped = jnp.sum((~kept & valid_rows).astype(jnp.int32))
  return y, dropped


@dataclasses.dataclass(frozen=True)
class ExpertParallelDispatch:
  """The MoE's routed experts over `mesh`: one shard_map over the token axes, experts owned
  by `expert` shards (an `ops.plan.ExecutionPlan.moe_dispatch`).

  Attributes:
    mesh: the run's mesh; it must have an `expert` axis (the other token axes are optional).
    capacity_factor: 0 -> dropless; c > 0 -> R = ceil(c a) receive rows per shard.
    exchange: ragged all-to-all implementation (`parallel.exchange`; "auto": emulated on CPU).
  """

  mesh: Mesh
  capacity_factor: float = 0.0
  exchange: ExchangeImpl = "auto"

  def __post_init__(self):
    if EXPERT_AXIS not in self.mesh.axis_names:
      raise ValueError(f"mesh axes {self.mesh.axis_names} have no {EXPERT_AXIS!r} axis: "
                       "expert parallelism needs one")
    if not (isinstance(self.capacity_factor, (int, float)) and self.capacity_factor >= 0):
      raise ValueError(f"capacity_factor={self.capacity_factor!r} is invalid: allowed 0 "
                       "(dropless) or a float > 0")
    resolve_impl(self.exchange)   # a clear error for an unknown name, before any trace

  def __call__(self, x: jax.Array, routes: Routes, bias: jax.Array, valid: jax.Array,
               w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, cfg: MoEConfig,
               glu: Callable, dtype, stats_routes: Routes | None = None,
               rows: int | None = None) -> tuple[jax.Array, Stats]:
    """Routed-expert FFN and routing statistics of all tokens (global views in and out).

    Args:
      x: [m, n] expert inputs (compute dtype); routes: `Routes` of the m tokens;
      bias: [E] fp32 routing bias; valid: [m] bool; w_gate, w_up [E, n, I]; w_down [E, I, n].
      cfg: the layer's MoEConfig; glu: gate nonlinearity; dtype: matmul dtype.
      stats_routes: the `Routes` the statistics describe (None: `routes`); under routing
        replay the router's own fresh top-k, while `routes` holds the replayed experts.
      rows: B when the m tokens are a flattened [B, T] batch (their layout, `token_axes`).

    Returns:
      y [m, n] fp32 over the assignments that were not dropped; `routing_stats` of the m
      tokens (of `stats_routes`) with "dropped" the valid assignments of `routes` dropped
      over the whole batch (always 0 when capacity_factor == 0). Integer psums: exactly
      the single-device statistics.
    """
    toks = token_axes(self.mesh, x.shape[0], rows)
    num_shards = self.mesh.shape[EXPERT_AXIS]
    num_experts = w_gate.shape[0]
    if num_experts % num_shards:
      raise ValueError(f"{num_experts} experts do not split over mesh.expert={num_shards}: "
                       "each expert shard owns whole experts")

    def body(x, routes, stats_routes, bias, valid, w_gate, w_up, w_down):
      y, dropped = expert_parallel_shard(
          x, routes.experts, routes.weights, valid, w_gate, w_up, w_down, glu=glu,
          dtype=dtype, num_experts=num_experts, num_shards=num_shards,
          capacity_factor=self.capacity_factor, impl=self.exchange)
      # Per-shard counts, one integer psum over all token shards: the pooled statistics.
      stats = routing_stats(routes if stats_routes is None else stats_routes, bias, valid,
                            cfg, dropped=dropped)
      return y, jax.lax.psum(stats, toks)

    tok, wspec = P(toks), P(EXPERT_AXIS)
    return jax.shard_map(body, mesh=self.mesh,
                         in_specs=(tok, tok, tok, P(), tok, wspec, wspec, wspec),
                         out_specs=(tok, P()), check_vma=False)(
                             x, routes, stats_routes, bias, valid, w_gate, w_up, w_down)
