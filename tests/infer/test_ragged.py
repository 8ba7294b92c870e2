"""Ragged prompts: rows of one prefill / generate call with different real lengths.

Each row must behave exactly as if it had been run alone: its cache advances by its own
length and its logits are those of its own last token.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.infer import Engine
from tests._support import TWO_LAYERS, rel_err, tiny_model
from tests.infer.helpers import random_tokens

LENGTHS = np.array([37, 9, 20], np.int32)   # 37 spans 3 chunks of 16; 9 ends in the first


@pytest.fixture(scope="module")
def setup():
  model = tiny_model(layer_kinds=TWO_LAYERS)
  engine = Engine(model, max_len=52, prefill_chunk=16, kv_block=8)
  tokens = np.asarray(random_tokens(4, 3, int(LENGTHS.max()) + 1))
  padded = np.where(np.arange(tokens.shape[1] - 1)[None] < LENGTHS[:, None], tokens[:, :-1], 0)
  return model, engine, tokens, padded


def _rows_alone(model, tokens, lengths):
  """Reference: the training forward over rows padded on the right (segment id 0): each
  row's logits at its real positions are those of the row alone. -> [B, T, V]."""
  seg = (np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  return np.asarray(nnx.jit(lambda m, t, s: m(t, segment_ids=s)[0])(model, tokens, seg))


def test_ragged_prefill_then_decode_matches_each_row_alone(setup):
  model, engine, tokens, padded = setup
  last, cache = engine.prefill(padded, lengths=LENGTHS)
  assert cache.length.tolist() == LENGTHS.tolist()
  nxt = tokens[np.arange(3), LENGTHS]
  step, cache = engine.decode_step(nxt, cache)
  assert cache.length.tolist() == (LENGTHS + 1).tolist()
  ref = _rows_alone(model, tokens, LENGTHS + 1)
  for b, n in enumerate(LENGTHS):
    assert rel_err(last[b], ref[b, n - 1]) < 1e-4, b
    assert rel_err(step[b], ref[b, n]) < 1e-4, b


def test_ragged_rows_continue_an_existing_cache(setup):
  """A second ragged prefill after a ragged one (a row may add 0 tokens: left untouched)."""
  model, engine, tokens, padded = setup
  first = np.array([5, 9, 3], np.int32)
  _, cache = engine.prefill(padded[:, :9], lengths=first)
  more = LENGTHS - first
  more[1] = 0
  rest = np.zeros((3, int(more.max())), np.int32)
  for b in range(3):
    rest[b, :more[b]] = tokens[b, first[b]:first[b] + more[b]]
  last, cache = engine.prefill(rest, cache, lengths=more)
  assert cache.length.tolist() == (first + more).tolist()
  ref = _rows_alone(model, tokens, LENGTHS + 1)
  for b in (0, 2):
    assert rel_err(last[b], ref[b, LENGTHS[b] - 1]) < 1e-4, b


def test_ragged_generate_continues_each_row_from_its_own_end(setup):
  """Greedy generate == greedy steps from the ragged prefill (checked against each row
  alone above); every row's cache ends at its own length."""
  _, engine, _, padded = setup
  out = engine.generate(padded, max_new_tokens=6, prompt_lengths=LENGTHS)
  logits, cache = engine.prefill(padded, lengths=LENGTHS)
  want = []
  for _ in range(6):
    tok = np.argmax(np.asarray(logits), -1).astype(np.int32)
    want.append(tok)
    logits, cache = engine.decode_step(tok, cache)
  np.testing.assert_array_equal(out.tokens, np.stack(want, 1))
  assert out.cache.length.tolist() == (LENGTHS + 5).tolist()


def test_ragged_score_and_forward_match_each_row_alone(setup):
  """score(lengths) and forward(lengths) (with and without a cache) over ragged rows: each
  row's real positions are the row alone's (`_rows_alone`); the cache holds its own length."""
  model, engine, _, padded = setup
  ref = _rows_alone(model, padded, LENGTHS)
  logp = np.asarray(jax.nn.log_softmax(ref, axis=-1))
  nll, pred = engine.score(padded, LENGTHS)
  full = engine.forward(padded, LENGTHS)
  cached, cache = engine.forward(padded, LENGTHS, return_cache=True)
  assert cache.length.tolist() == LENGTHS.tolist()
  for b, n in enumerate(LENGTHS):
    want = -logp[b, np.arange(n - 1), padded[b, 1:n]]
    np.testing.assert_allclose(nll[b, :n - 1], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(pred[b, :n - 1], ref[b, :n - 1].argmax(-1))
    assert rel_err(full[b, :n], ref[b, :n]) < 1e-4 and rel_err(cached[b, :n], ref[b, :n]) < 1e-4
  with pytest.raises(ValueError, match=r"lengths must lie in \[1, 37\]"):
    engine.score(padded, [0, 3, 3])
  with pytest.raises(ValueError, match="max_len=52"):       # a cache of 52 cannot hold 60
    engine.forward(np.zeros((1, 60), np.int32), return_cache=True)
  assert engine.forward(np.zeros((1, 60), np.int32)).shape[1] == 60  # no cache: no limit


def test_ragged_bad_lengths(setup):
  _, engine, _, padded = setup
  with pytest.raises(ValueError, match=r"lengths must lie in \[0, 37\]"):
    engine.prefill(padded, lengths=[38, 1, 1])
  with pytest.raises(ValueError, match=r"lengths must be integers \[B=3\]"):
    engine.prefill(padded, lengths=[3, 1])
  with pytest.raises(ValueError, match=r"lengths must lie in \[1, 37\]"):
    engine.generate(padded, max_new_tokens=2, prompt_lengths=[0, 3, 3])
  _, cache = engine.prefill(padded, lengths=LENGTHS)
  with pytest.raises(ValueError, match="max_len=52"):       # row 0: 37 + 16 > 52
    engine.prefill(padded[:, :16], cache, lengths=[16, 1, 1])
  _, cache = engine.prefill(padded, lengths=LENGTHS)
  _, cache = engine.prefill(padded[:, :16], cache, lengths=[15, 16, 16])  # fits row by row
  assert cache.length.tolist() == [52, 25, 36]
