"""Synthetic task generators and scorers: NIAH, MQAR, perplexity buckets, option checks."""

import numpy as np
import pytest

from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.evals import mqar, niah, ppl, runner
from hybridmoe_jax.evals.runner import resolve_tasks


@pytest.mark.parametrize("length", [128, 300, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_niah_needle_once_at_depth(length, depth):
  ex = niah.make_example(np.random.default_rng(length), length, depth, num_digits=5)
  assert ex.prompt.shape == (length,) and ex.prompt.dtype == np.int32
  text = ByteTokenizer().decode(ex.prompt)
  assert text.count(ex.answer) == 1 and sum(ch.isdigit() for ch in text) == 5
  needle = f"The pass key is {ex.answer}."
  assert text.index(needle) == ex.needle_start - 1          # BOS is not text
  haystack = length - 1 - len(needle + " Remember it. ") - len(niah.QUESTION)
  # Snapped to a sentence boundary: within half the longest filler sentence of the depth.
  assert abs((ex.needle_start - 1) - depth * haystack) <= 22
  assert text.endswith(niah.QUESTION)


def test_niah_scoring_oracle_and_constant_guess():
  rng = np.random.default_rng(0)
  answers = [str(d) for d in rng.integers(0, 10, 2000)]
  assert niah.exact_match(answers, answers) == 1.0
  assert niah.exact_match([a + "junk" for a in answers], answers) == 1.0   # prefix match
  assert abs(niah.exact_match(["7"] * 2000, answers) - 0.1) < 0.025        # chance = 1/10
  assert niah.digit_accuracy(["12345", "1", "92300"], ["12345", "12345", "12345"]) == (
      pytest.approx((1 + 0.2 + 0.4) / 3))                 # per place; short predictions miss
  assert abs(niah.digit_accuracy(["7"] * 2000, answers) - 0.1) < 0.025
  with pytest.raises(ValueError, match="too short"):
    niah.make_example(rng, 40, 0.5)
  with pytest.raises(ValueError, match="depth"):
    niah.make_example(rng, 400, 1.5)


def test_mqar_structure():
  b = mqar.make_mqar(np.random.default_rng(1), 64, 256, 16)
  keys_r, vals_r, noise_r = mqar.token_ranges(256)
  assert b.inputs.shape == b.targets.shape == (64, 256)
  for i in range(64):
    ctx = b.inputs[i, :32]
    np.testing.assert_array_equal(ctx[0::2], b.keys[i])
    np.testing.assert_array_equal(ctx[1::2], b.values[i])
    assert len(set(b.keys[i])) == 16 and len(set(b.values[i])) == 16
    assert all(k in keys_r for k in b.keys[i]) and all(v in vals_r for v in b.values[i])
    # Each key occurs exactly twice (context + its query), each value once.
    for k, v in zip(b.keys[i], b.values[i]):
      assert (b.inputs[i] == k).sum() == 2 and (b.inputs[i] == v).sum() == 1
    scored = np.flatnonzero(b.targets[i] >= 0)
    np.testing.assert_array_equal(np.sort(b.query_pos[i]), scored)
    for p in b.query_pos[i]:
      assert p >= 32 and (p - 32) % 2 == 0
      k = b.inputs[i, p]
      assert b.targets[i, p] == b.values[i][list(b.keys[i]).index(k)]
    rest = np.delete(np.arange(256), np.concatenate([np.arange(32), b.query_pos[i]]))
    assert all(t in noise_r for t in b.inputs[i, rest])
  gaps = (b.query_pos - 32) // 2
  assert np.mean(gaps < 28) > 0.3                 # power law: short gaps dominate (uniform: 0.25)


def test_mqar_scoring_oracle_and_constant_guess():
  b = mqar.make_mqar(np.random.default_rng(2), 400, 64, 8)
  shifted = b.targets[:, :-1]                     # a prediction at i is for token i + 1
  assert mqar.accuracy(np.where(shifted >= 0, shifted, 0), shifted) == 1.0
  guess = np.full_like(shifted, mqar.token_ranges(256)[1].start)
  chance = 1 / len(mqar.token_ranges(256)[1])
  assert abs(mqar.accuracy(guess, shifted) - chance) < 0.01
  with pytest.raises(ValueError, match="fit"):
    mqar.make_mqar(np.random.default_rng(0), 1, 30, 8)


def test_ppl_buckets():
  nll = np.arange(1, 11, dtype=np.float64)        # contexts 1..10
  targets = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 258])
  rows = ppl.bucket_stats(nll, targets, [0, 4, 8])
  assert [r["tokens"] for r in rows] == [3, 4, 3]
  assert [r["nll_sum"] for r in rows] == [6.0, 22.0, 27.0]
  assert [r["bytes"] for r in rows] == [3, 4, 2]    # the EOS target is not a byte
  assert ppl.bucket_edges(300) == [0, 64, 256]


def test_options_and_tasks():
  assert resolve_tasks("all") == ["ppl", "niah", "mqar", "generate"]
  with pytest.raises(ValueError, match="unknown task"):
    resolve_tasks("bleu")
  opts = runner.options_from_flags({"niah_lengths": ["96", "128"], "niah_depths": ["0", "0.5"]})
  assert opts.niah_lengths == (96, 128) and opts.niah_depths == (0.0, 0.5)
  with pytest.raises(ValueError, match="niah_lengths"):
    runner.options_from_flags({"niah_lengths": ["x"]})
  with pytest.raises(ValueError, match="max_new_tokens"):
    runner.options_from_flags({"max_new_tokens": 0})


def test_niah_key_nll_is_the_teacher_forced_score_and_greedy_is_generate():
  """The graded NIAH signal: a key's NLL from the prompt's cache == Engine.score of prompt +
  key; the greedy continuation == Engine.generate (tiny random model, fp32)."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.config import model_config_from_dict  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.infer import Engine  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.model import HybridLM  # pylint: disable=g-import-not-at-top
  from tests.conftest import load_config  # pylint: disable=g-import-not-at-top
  model = HybridLM(model_config_from_dict(load_config("tiny").model), rngs=nnx.Rngs(0))
  engine = Engine(model, max_len=136, prefill_chunk=64, kv_block=32)
  rng = np.random.default_rng(3)
  prompts = np.stack([niah.make_example(rng, 128, d).prompt for d in (0.2, 0.8)])
  keys = rng.integers(48, 58, (2, 5)).astype(np.int32)        # digit bytes
  logits, cache = engine.prefill(prompts)
  got = niah._key_nll(engine, logits, cache, keys)  # pylint: disable=protected-access
  nll, _ = engine.score(np.concatenate([prompts, keys], 1))
  np.testing.assert_allclose(got, nll[:, -5:].sum(1), rtol=1e-5)
  greedy, _ = niah._continue(engine, logits, cache, None, 5)  # pylint: disable=protected-access
  want = engine.generate(prompts, max_new_tokens=5).tokens
  np.testing.assert_array_equal(greedy, want)
  assert int(jax.device_get(cache.length)[0]) == 128   # the prompt's cache was not consumed
  r = niah.evaluate_niah(engine, [128], [0.5], samples=2, tokenizer=ByteTokenizer(chat=True))
  assert np.shape(r["key_nll_gain"]) == (1, 1) and r["key_nll"][0][0] > 0
