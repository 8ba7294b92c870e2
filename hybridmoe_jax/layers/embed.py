"""Token embedding lookup whose communication is all-to-alls of the looked-up rows.

The table [V, d] is a ZeRO-3 weight: its width d is split over the `embed` axes (fsdp,
context, expert; `config.sharding`) and V over tensor. Left to XLA's partitioner, the
lookup gathered the rows of the whole microbatch on every device (Kimi K3 on v5p-2048:
bf16 [64, 4096, 7168] = 3.5 GiB per chip, two or three live at once, plus the whole bf16
table), and resharding the looked-up rows from d to the batch was an "involuntary full
rematerialization". Here, inside one `shard_map`:
  1. every device of the table's width split sees the token ids of its rows (int32);
  2. it looks up its own d-slice of those rows (vocabulary split over tensor: a masked
     lookup and a psum over tensor), [B', T, d / n], no other communication;
  3. per width axis, one all-to-all trades d-slices for rows (an axis that splits the
     batch) or positions (context); where the rows or positions do not divide, the slices
     are summed into place (every device gets all of d); a local transpose puts the
     d-slices back in order.
The lookup is in the table's dtype (fp32 master) and the cast follows it, so no
compute-dtype copy of the table is made. Numerically it is always exactly `table[ids]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybridmoe_jax.config import sharding


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def embed_lookup(table: jax.Array, ids: jax.Array, dtype, *, serving: bool = False
                 ) -> jax.Array:
  """table [V, d] (any float dtype), ids [B, T] int -> [B, T, d] in `dtype`, laid out as
  the activations ("batch", "length", "act_embed").

  `serving`: the table is laid out for serving (whole over context and expert, a few rows
  per step): a plain lookup, which XLA partitions without moving the table."""
  mesh = jax.sharding.get_abstract_mesh()
  if serving or mesh is None or mesh.empty or mesh.size == 1:
    return jnp.take(table, ids, axis=0).astype(dtype)
  shape = dict(mesh.shape)
  b, t = ids.shape
  vocab_spec, width_spec = (tuple(sharding.spec_for(("vocab", "embed"), table.shape, shape))
                            + (None, None))[:2]
  vocab, width = _axes(vocab_spec), _axes(width_spec)
  out = sharding.spec_for(("batch", "length"), (b, t), shape)
  out_rows, out_len = (_axes(e) for e in (tuple(out) + (None, None))[:2])
  rows = tuple(a for a in out_rows if a not in width)   # rows split before the exchange
  # Per width axis, what the exchange trades its d-slices for: rows, positions or nothing.
  # Rows are traded in the output's axis order, so the result needs no further reshard.
  plan = [(a, 0) for a in out_rows if a in width] + [(a, 1) for a in out_len if a in width]
  plan += [(a, None) for a in width if a not in out_rows + out_len]
  sizes = {a: shape[a] for a in width}

  def body(tab, idx):
    v_local = tab.shape[0]
    if vocab:  # this device's rows of the vocabulary
      start = jax.lax.axis_index(vocab) * v_local
      local = idx - start
      hit = (local >= 0) & (local < v_local)
      x = jnp.where(hit[..., None], jnp.take(tab, jnp.clip(local, 0, v_local - 1), axis=0), 0)
      x = jax.lax.psum(x, vocab)
    else:
      x = jnp.take(tab, idx, axis=0)
    for axis, split in plan:
      if split is None:  # rows / positions do not divide: every device gets all of d
        # (a psum of zero-padded slices: unlike all_gather, it is typed replicated)
        n, d_local = sizes[axis], x.shape[2]
        slot = jnp.zeros(x.shape[:2] + (n * d_local,), x.dtype)
        slot = jax.lax.dynamic_update_slice_in_dim(
            slot, x, jax.lax.axis_index(axis) * d_local, axis=2)
        x = jax.lax.psum(slot, axis)
      else:
        x = jax.lax.all_to_all(x, axis, split, 2, tiled=True)
    # d now holds the slices in the order traded (the first axis minor): back to the
    # table's order (its first width axis major).
    traded = [a for a, _ in plan]
    x = x.reshape(x.shape[:2] + tuple(sizes[a] for a in reversed(traded)) + (-1,))
    order = [len(traded) - 1 - traded.index(a) for a in width]
    x = x.transpose((0, 1) + tuple(2 + i for i in order) + (2 + len(width),))
    return x.reshape(x.shape[:2] + (-1,))

  lookup = jax.shard_map(
      body, mesh=mesh,
      in_specs=(jax.P(vocab_spec, width_spec), jax.P(_entry(rows), None)),
      out_specs=jax.P(_entry(out_rows), _entry(out_len), None))
  return lookup(table, ids).astype(dtype)
