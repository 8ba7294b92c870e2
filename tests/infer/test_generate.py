"""generate(): greedy determinism, stop tokens, sampling filters, one compilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe_jax.infer import Engine, SamplingConfig, trace_counts
from hybridmoe_jax.infer.sampling import filter_logits, sample
from tests._support import tiny_model
from tests.infer.helpers import random_tokens

NEW = 12


@pytest.fixture(scope="module")
def engine():
  return Engine(tiny_model(), max_len=32, prefill_chunk=16, kv_block=8)


def test_greedy_is_deterministic_and_matches_step_by_step(engine):
  prompt = random_tokens(0, 2, 9)
  a = engine.generate(prompt, max_new_tokens=NEW)
  b = engine.generate(prompt, max_new_tokens=NEW)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert a.tokens.shape == (2, NEW) and list(a.lengths) == [NEW, NEW]
  logits, cache = engine.prefill(prompt)
  want = []
  for _ in range(NEW):
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    want.append(tok)
    logits, cache = engine.decode_step(tok, cache)
  np.testing.assert_array_equal(a.tokens, np.stack(want, 1))


def test_stops_at_stop_tokens_without_recompiling(engine):
  prompt = random_tokens(0, 2, 9)
  free = engine.generate(prompt, max_new_tokens=NEW).tokens
  before = trace_counts()["generate"]
  stop = int(free[0, 3])                      # row 0 emits it at step 3 (maybe earlier)
  first = int(np.argmax(free[0] == stop))
  out = engine.generate(prompt, max_new_tokens=NEW, stop_tokens=[stop, 300], pad_id=256)
  assert out.lengths[0] == first + 1
  np.testing.assert_array_equal(out.tokens[0, :first + 1], free[0, :first + 1])
  assert (out.tokens[0, first + 1:] == 256).all()
  hit = np.flatnonzero(free[1] == stop)
  assert out.lengths[1] == (hit[0] + 1 if hit.size else NEW)
  # New prompt, stop set and sampling parameters: the same compiled loop.
  engine.generate(random_tokens(5, 2, 9), max_new_tokens=NEW, stop_tokens=[1, 2, 3],
                  sampling=SamplingConfig(temperature=0.8, top_k=20, top_p=0.9), seed=3)
  assert trace_counts()["generate"] == before


def test_max_length_and_bad_input(engine):
  out = engine.generate(random_tokens(1, 2, 27), max_new_tokens=NEW)   # room for 5 only
  assert list(out.lengths) == [5, 5] and out.cache.length.tolist() == [31, 31]
  with pytest.raises(ValueError, match="no room"):
    engine.generate(random_tokens(1, 1, 32), max_new_tokens=4)
  with pytest.raises(ValueError, match="max_len"):
    engine.generate(random_tokens(1, 1, 40), max_new_tokens=4)
  with pytest.raises(ValueError, match="empty"):
    engine.generate(np.zeros((1, 0), np.int32), max_new_tokens=4)
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(temperature=1.0, top_p=0.0)


def test_sampling_seeded_and_top_k1_is_greedy(engine):
  prompt = random_tokens(2, 2, 9)
  hot = SamplingConfig(temperature=1.5)
  a = engine.generate(prompt, max_new_tokens=NEW, sampling=hot, seed=1).tokens
  b = engine.generate(prompt, max_new_tokens=NEW, sampling=hot, seed=1).tokens
  c = engine.generate(prompt, max_new_tokens=NEW, sampling=hot, seed=2).tokens
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  k1 = engine.generate(prompt, max_new_tokens=NEW, sampling=SamplingConfig(1.5, top_k=1)).tokens
  np.testing.assert_array_equal(k1, engine.generate(prompt, max_new_tokens=NEW).tokens)


def test_filter_logits_top_k_and_top_p():
  logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
  kept = lambda k, p: np.asarray(filter_logits(logits, jnp.int32(k), jnp.float32(p)) > -1e29)
  assert kept(0, 1.0).tolist() == [[True] * 5]
  assert kept(2, 1.0).tolist() == [[True, True, False, False, False]]
  assert kept(0, 0.5).tolist() == [[True, False, False, False, False]]     # 0.5 reaches 0.5
  assert kept(0, 0.6).tolist() == [[True, True, False, False, False]]
  assert kept(3, 0.9).tolist() == [[True, True, True, False, False]]      # k binds first
  keys = jax.random.split(jax.random.PRNGKey(0), 2000)
  draws = jax.vmap(lambda k: sample(logits, k, jnp.float32(1.0), jnp.int32(0),
                                    jnp.float32(0.75)))(keys)[:, 0]
  freq = np.bincount(np.asarray(draws), minlength=5) / 2000
  np.testing.assert_allclose(freq[:3], [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85], atol=0.04)
  assert freq[3:].sum() == 0


def test_a_top_p_too_small_for_float32_keeps_the_most_likely_id():
  """top_p=1e-50 is in (0, 1] but 0 in float32: the nucleus is the top id (ties kept), not
  an empty set, from which every draw was id 0 whatever the logits."""
  logits = jnp.array([[0.0, 10.0, -5.0, 1.0], [3.0, -1.0, 7.0, 7.0]])
  kept = np.asarray(filter_logits(logits, jnp.int32(0), jnp.float32(1e-50)) > -1e29)
  assert kept.tolist() == [[False, True, False, False], [False, False, True, True]]
  draws = jax.vmap(lambda k: sample(logits, k, jnp.float32(1.0), jnp.int32(0),
                                    jnp.float32(1e-50)))(
                                        jax.random.split(jax.random.PRNGKey(0), 100))
  assert set(np.asarray(draws[:, 0]).tolist()) == {1}
  assert set(np.asarray(draws[:, 1]).tolist()) == {2, 3}


def test_vocab_limit_never_draws_ids_past_the_tokenizer():
  logits = jnp.zeros((2, 10)).at[:, 8].set(5.0).at[:, 3].set(1.0)
  assert list(sample(logits, jax.random.PRNGKey(0), jnp.float32(0.0), jnp.int32(0),
                     jnp.float32(1.0), jnp.int32(8))) == [3, 3]
  draws = jax.vmap(lambda k: sample(logits, k, jnp.float32(2.0), jnp.int32(0),
                                    jnp.float32(1.0), jnp.int32(8)))(
                                        jax.random.split(jax.random.PRNGKey(1), 200))
  assert int(draws.max()) < 8
