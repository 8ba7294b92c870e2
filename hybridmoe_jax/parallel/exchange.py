"""Ragged all-to-all over one mesh axis: the real collective and an all_gather emulation.

Contract (`jax.lax.ragged_all_to_all`, called inside `jax.shard_map`): shard s sends rows
operand[input_offsets[j] : input_offsets[j] + send_sizes[j]] to shard j, where they are
written at output_j[output_offsets[j] : ... + send_sizes[j]]. `output_offsets` are
SENDER-side: positions in the receiver's buffer. recv_sizes[i] must equal shard i's
send_sizes[s]. Rows of `output` that nobody writes keep their value.

XLA:CPU has no ragged all-to-all, so on CPU (`impl="auto"`) the same result is computed by
all-gathering every shard's operand and offsets and scattering this shard's incoming rows.
It moves G times more data than the real collective: a test/CPU path, not a fast one.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from hybridmoe_jax.ops.platform import target_platform

ExchangeImpl = Literal["auto", "native", "emulated"]


def resolve_impl(impl: ExchangeImpl) -> str:
  """"auto" -> "emulated" when the target platform is CPU (no ragged_all_to_all in
  XLA:CPU), else "native". The target is the platform the program is compiled for
  (`ops.platform.target_platform`: the mesh's devices), so an ahead-of-time compile for a
  TPU topology on a CPU host gets the native collective."""
  return resolve_impl_why(impl)[0]


def resolve_impl_why(impl: ExchangeImpl) -> tuple[str, str]:
  """-> (`resolve_impl`'s choice, the reason: requested, or the target platform and where
  it came from)."""
  if impl not in ("auto", "native", "emulated"):
    raise ValueError(f"exchange impl={impl!r} is invalid: allowed 'auto', 'native', 'emulated'")
  if impl != "auto":
    return impl, "requested"
  platform, where = target_platform()
  name = "emulated" if platform == "cpu" else "native"
  return name, f"exchange='auto' on {platform} ({where})"


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name: str, num_shards: int):
  """`jax.lax.ragged_all_to_all` semantics from one all_gather and one scatter.

  Args:
    operand: [N, ...] rows to send; output: [M, ...] receive buffer (same trailing dims).
    input_offsets, send_sizes, output_offsets: [G] int32, this shard's sends (see module).
    recv_sizes: [G] int32; unused beyond the contract (the sender's sizes are authoritative).
    axis_name: the mesh axis; num_shards: its size G (static).

  Returns:
    [M, ...]: `output` with every incoming slice written; rows that would land outside
    [0, M) are dropped (callers size their sends so that none do).
  """
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  n = operand.shape[0]
  rows = jax.lax.all_gather(operand, axis_name)                       # [G, N, ...]
  gather = lambda v: jax.lax.all_gather(v.astype(jnp.int32), axis_name)  # [G, G]
  start, size, dest = gather(input_offsets), gather(send_sizes), gather(output_offsets)
  r = jnp.arange(n, dtype=jnp.int32)[None, :]                         # [1, N]
  src = jnp.clip(start[:, me][:, None] + r, 0, n - 1)                 # [G, N] sender rows
  ok = r < size[:, me][:, None]
  out_rows = output.shape[0]
  pos = jnp.where(ok, dest[:, me][:, None] + r, out_rows)             # out of range = skip
  picked = jnp.take_along_axis(rows, src.reshape(src.shape + (1,) * (rows.ndim - 2)), axis=1)
  return output.at[pos.reshape(-1)].set(
      picked.reshape((num_shards * n,) + operand.shape[1:]).astype(output.dtype), mode="drop")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, axis_name: str, num_shards: int, impl: ExchangeImpl = "auto"):
  """Dispatch to the native collective or its emulation (same arguments and result)."""
  if resolve_impl(impl) == "native":
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=axis_name)
  return emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                    output_offsets, recv_sizes, axis_name=axis_name,
                                    num_shards=num_shards)
