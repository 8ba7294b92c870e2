"""`layers.embed.embed_lookup` on meshes: exactly `table[ids]` forward and backward, and the
rows of the whole batch are never gathered on one device (what XLA did for Kimi K3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe_jax.config.sharding import spec_for
from hybridmoe_jax.layers.embed import embed_lookup
from hybridmoe_jax.parallel import rules
from tests.parallel.helpers import HLO_ARRAY, make_mesh

V, D, B, T = 96, 64, 8, 32


def _inputs(b=B, t=T):
  k1, k2 = jax.random.split(jax.random.key(0))
  table = jax.random.normal(k1, (V, D), jnp.float32)
  ids = jax.random.randint(k2, (b, t), 0, V)
  return table, ids


# The last two: rows that do not divide over expert (2 rows), an odd length over context.
@pytest.mark.parametrize("sizes,b,t", [
    (dict(fsdp=2, expert=2, context=2), B, T), (dict(fsdp=8), B, T),
    (dict(data=2, fsdp=2, tensor=2), B, T), (dict(expert=4, tensor=2), B, T),
    (dict(fsdp=2, expert=2, context=2), 2, T), (dict(fsdp=2, expert=2, context=2), B, 31)])
def test_lookup_equals_take_forward_and_backward(sizes, b, t):
  table, ids = _inputs(b, t)
  cot = jax.random.normal(jax.random.key(1), (b, t, D), jnp.float32)
  loss = lambda f: lambda t: jnp.sum(f(t, ids) * cot)
  want = jnp.take(table, ids, axis=0).astype(jnp.bfloat16)
  want_grad = jax.grad(loss(lambda t, i: jnp.take(t, i, axis=0)))(table)
  mesh = make_mesh(**sizes)
  with jax.set_mesh(mesh):
    shard = rules.tree_shardings({"embed": {"embedding": table}}, mesh)["embed"]["embedding"]
    placed = jax.device_put(table, shard)
    got = jax.jit(lambda t, i: embed_lookup(t, i, jnp.bfloat16))(placed, ids)
    grad = jax.jit(jax.grad(loss(lambda t, i: embed_lookup(t, i, jnp.float32))))(placed)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-6)


def test_no_device_holds_the_whole_batch_of_rows():
  """fsdp 2 x expert 2 x context 2: each device ends with B/4 rows x T/2 positions, and no
  array of the compiled forward + backward is as large as the batch's rows [B, T, d]."""
  table, ids = _inputs()
  mesh = make_mesh(fsdp=2, expert=2, context=2)
  with jax.set_mesh(mesh):
    shard = rules.tree_shardings({"embed": {"embedding": table}}, mesh)["embed"]["embedding"]
    assert shard.spec == spec_for(("vocab", "embed"), (V, D), dict(mesh.shape))
    placed = jax.device_put(table, shard)
    fn = jax.jit(jax.value_and_grad(lambda t: jnp.sum(embed_lookup(t, ids, jnp.float32) ** 2)))
    hlo = fn.lower(placed).compile().as_text()
    out = jax.jit(lambda t: embed_lookup(t, ids, jnp.float32))(placed)
  assert out.addressable_shards[0].data.shape == (B // 4, T // 2, D)
  whole = B * T * D
  sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
           for _, dims in HLO_ARRAY.findall(hlo)]
  assert max(sizes) < whole, max(sizes)
