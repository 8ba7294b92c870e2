"""Engine.generate compiles per batch bucket only: the same tokens as the exact-shape path
(bucket=False), and no new trace for a new max_new_tokens or a batch in a compiled bucket."""

import numpy as np
import pytest

from hybridmoe_jax.infer import Engine, SamplingConfig, trace_counts
from hybridmoe_jax.infer.engine import batch_bucket
from tests._support import tiny_model
from tests.infer.helpers import random_tokens


@pytest.fixture(scope="module")
def engine():
  return Engine(tiny_model(), max_len=32, prefill_chunk=16, kv_block=8)


def _ragged(seed, b):
  tokens = np.asarray(random_tokens(seed, b, 11))
  return tokens, np.asarray([11, 4, 7, 1, 9][:b], np.int32)


def test_batch_bucket_is_the_next_power_of_two():
  assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 16, 128]


@pytest.mark.parametrize("sampling", [SamplingConfig(),
                                      SamplingConfig(temperature=0.9, top_k=20, top_p=0.95)],
                         ids=["greedy", "sampled"])
def test_bucketed_equals_the_exact_shape_path(engine, sampling):
  """3 ragged rows padded to the bucket of 4 and a loop as wide as the cache: the tokens,
  lengths and cache lengths of the unpadded, exact-width call (a stop id included)."""
  tokens, lengths = _ragged(0, 3)
  free = engine.generate(tokens, max_new_tokens=7, sampling=sampling, seed=5,
                         prompt_lengths=lengths, bucket=False)
  stop = [int(free.tokens[1, 2])]
  args = dict(max_new_tokens=7, sampling=sampling, seed=5, prompt_lengths=lengths,
              stop_tokens=stop, pad_id=3)
  want = engine.generate(tokens, bucket=False, **args)
  got = engine.generate(tokens, **args)
  assert got.tokens.shape == (3, 7) and want.lengths[1] <= 3
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  np.testing.assert_array_equal(np.asarray(got.cache.length), np.asarray(want.cache.length))


def test_more_new_tokens_than_the_cache_holds_keeps_the_asked_width(engine):
  """max_new_tokens past max_len: [B, max_new_tokens] as before, pad_id after the cache's
  room, the same as the exact-shape path."""
  tokens, lengths = _ragged(3, 2)
  got = engine.generate(tokens, max_new_tokens=40, prompt_lengths=lengths, pad_id=3)
  want = engine.generate(tokens, max_new_tokens=40, prompt_lengths=lengths, pad_id=3,
                         bucket=False)
  assert got.tokens.shape == (2, 40)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)


def test_no_trace_for_a_new_max_new_tokens_or_batch_in_a_bucket(engine):
  tokens, lengths = _ragged(1, 4)
  engine.generate(tokens[:3], max_new_tokens=5, prompt_lengths=lengths[:3])   # bucket 4
  before = trace_counts()
  for b, new in ((3, 1), (4, 9), (3, 20), (4, 2)):
    engine.generate(tokens[:b], max_new_tokens=new, prompt_lengths=lengths[:b],
                    sampling=SamplingConfig(temperature=0.7), seed=b)
  after = trace_counts()
  assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {}
  engine.generate(random_tokens(2, 5, 6), max_new_tokens=3)   # bucket 8: one new loop
  assert trace_counts()["generate"] == after["generate"] + 1
