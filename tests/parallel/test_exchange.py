"""The ragged all-to-all emulation and the EP exchange plan against numpy models of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from hybridmoe_jax.parallel.ep_moe import buffer_rows, exchange_plan
from hybridmoe_jax.parallel.exchange import emulated_ragged_all_to_all, resolve_impl

G = 4


def _numpy_ragged_all_to_all(operands, outputs, in_off, send, out_off):
  """Reference: shard i's rows [in_off[i,j], +send[i,j]) land at out_off[i,j] on shard j."""
  outputs = [o.copy() for o in outputs]
  for i in range(len(operands)):
    for j in range(len(operands)):
      n = send[i, j]
      outputs[j][out_off[i, j]:out_off[i, j] + n] = operands[i][in_off[i, j]:in_off[i, j] + n]
  return outputs


def test_auto_is_emulated_on_cpu():
  assert resolve_impl("auto") == "emulated"
  with pytest.raises(ValueError, match="auto"):
    resolve_impl("nccl")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emulation_matches_numpy_model(seed):
  rng = np.random.default_rng(seed)
  n, m, width = 12, 20, 3
  # Random group sizes with many empty groups; packed senders, receivers laid out by sender.
  send = rng.integers(0, 4, size=(G, G)) * (rng.random((G, G)) < 0.6)
  send[0, :] = 0                                   # a shard that sends nothing at all
  in_off = np.zeros((G, G), np.int64)
  for i in range(G):                               # gaps between chunks: offsets, not sizes
    pos = 0
    for j in range(G):
      pos += rng.integers(0, 2)
      in_off[i, j] = pos
      pos += send[i, j]
    assert pos <= n
  out_off = np.zeros((G, G), np.int64)
  for j in range(G):
    pos = 1
    for i in range(G):
      out_off[i, j] = pos
      pos += send[i, j]
    assert pos <= m
  operands = rng.normal(size=(G, n, width)).astype(np.float32)
  outputs = np.full((G, m, width), -7.0, np.float32)
  want = _numpy_ragged_all_to_all(list(operands), list(outputs), in_off, send, out_off)

  mesh = Mesh(np.asarray(jax.devices()[:G]), ("x",))
  def body(op, out, io, ss, oo, rs):
    return emulated_ragged_all_to_all(op[0], out[0], io[0], ss[0], oo[0], rs[0],
                                      axis_name="x", num_shards=G)[None]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"),
                            check_vma=False))
  i32 = lambda a: jnp.asarray(a, jnp.int32)
  got = f(operands, outputs, i32(in_off), i32(send), i32(out_off), i32(send.T))
  np.testing.assert_array_equal(np.asarray(got), np.stack(want))


def _numpy_plan(counts, me, cap):
  g, e = counts.shape
  el = e // g
  per_dest = counts.reshape(g, g, el).sum(-1)
  start = np.zeros_like(per_dest)         # start[i, j]: where i's rows begin in j's buffer
  for j in range(g):
    start[1:, j] = np.cumsum(per_dest[:-1, j])
  eff = np.minimum(per_dest, np.maximum(cap - start, 0))
  send_off = np.concatenate([[0], np.cumsum(per_dest[me])[:-1]])
  back_dest = np.array([np.concatenate([[0], np.cumsum(per_dest[i])[:-1]])[me]
                        for i in range(g)])
  ends = np.cumsum(counts[:, me * el:(me + 1) * el].reshape(-1))
  return dict(send_offsets=send_off, send_sizes=eff[me], dest_offsets=start[me],
              recv_sizes=eff[:, me], recv_offsets=start[:, me], back_dest=back_dest,
              back_recv=eff[me], group_ends=ends)


@pytest.mark.parametrize("cap_factor", [0.0, 1.0, 0.5])
def test_exchange_plan_matches_numpy(cap_factor):
  rng = np.random.default_rng(3)
  e = 8
  counts = rng.integers(0, 5, size=(G, e)) * (rng.random((G, e)) < 0.5)
  counts[:, :2] += 6                      # skew towards shard 0
  a = 10
  cap = buffer_rows(a, G, cap_factor)
  assert cap == (G * a if cap_factor == 0 else int(np.ceil(cap_factor * a)))
  for me in range(G):
    got = jax.jit(exchange_plan, static_argnums=2)(jnp.asarray(counts, jnp.int32), me, cap)
    want = _numpy_plan(counts, me, cap)
    for key, value in want.items():
      np.testing.assert_array_equal(np.asarray(got[key]), value, err_msg=f"{key} shard {me}")
