"""Block AttnRes: uniform mixing at init, block bookkeeping for any depth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe_jax.layers.attnres import BlockStream, depth_mix, num_blocks


def test_zero_query_is_uniform_average_of_valid_sources():
  buf = jax.random.normal(jax.random.PRNGKey(0), (5, 2, 3, 8))
  valid = jnp.array([True, True, False, True, False])
  h = depth_mix(jnp.zeros(8), buf, valid, 1e-5)
  np.testing.assert_allclose(h, buf[jnp.array([0, 1, 3])].mean(0), rtol=1e-6, atol=1e-6)


def test_nonzero_query_softmax_over_depth():
  key_b, key_q = jax.random.split(jax.random.PRNGKey(1))
  buf = jax.random.normal(key_b, (3, 1, 2, 4))
  w = jax.random.normal(key_q, (4,))
  h = depth_mix(w, buf, jnp.array([True, True, True]), 1e-5)
  b = np.asarray(buf, np.float64)
  keys = b / np.sqrt((b ** 2).mean(-1, keepdims=True) + 1e-5)
  logits = np.einsum("d,sbtd->sbt", np.asarray(w, np.float64), keys)
  p = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
  np.testing.assert_allclose(h, np.einsum("sbt,sbtd->btd", p, b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layers, block, blocks", [(4, 2, 2), (5, 2, 3), (93, 12, 8),
                                                    (7, 7, 1), (3, 8, 1), (6, 1, 6)])
def test_block_count(layers, block, blocks):
  assert num_blocks(layers, block) == blocks


def test_stream_accumulates_blocks_and_marks_valid():
  emb = jnp.ones((1, 2, 4))
  s = BlockStream.start(emb, 3)
  assert s.valid.tolist() == [True, False, False]
  s = s.add(1, 2 * emb).add(1, 3 * emb).add(2, emb)
  assert s.valid.tolist() == [True, True, True]
  np.testing.assert_allclose(s.buf[1], 5 * emb)
  np.testing.assert_allclose(s.buf[2], emb)
