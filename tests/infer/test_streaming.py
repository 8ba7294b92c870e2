"""Token streaming: TextStream (incremental detokenization, stop strings) against the whole
decode, and Engine.generate_stream against Engine.generate token for token."""

import numpy as np
import pytest

from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.infer import Engine, SamplingConfig
from hybridmoe_jax.infer.streaming import TextStream, stream_text
from tests._support import TWO_LAYERS, tiny_model
from tests.infer.helpers import random_tokens

TOK = ByteTokenizer()


def _pieces(ids, stop=()):
  s = TextStream(TOK, stop)
  out = [s.push(i) for i in ids]
  return out, s.finish(), s


def test_multibyte_characters_wait_for_their_last_byte():
  ids = list("aé€😀b".encode())
  pieces, tail, s = _pieces(ids)
  assert "".join(pieces) + tail == s.text == "aé€😀b"
  assert "\ufffd" not in "".join(pieces)          # never a half character on screen
  assert pieces[:3] == ["a", "", "é"]              # é = 2 bytes: shown with its second


def test_stop_strings_cut_across_tokens_and_held_prefixes_are_released():
  text = "say END? no, ENDED here"
  pieces, tail, s = _pieces(list(text.encode()), stop=("ENDED",))
  assert s.stopped and s.text == "say END? no, " and tail == ""
  assert "".join(pieces) == "say END? no, "
  # "END" was held while it could still become "ENDED", then released at "?".
  assert pieces[text.index("?")] == "END?"
  assert stream_text(TOK, list(b"abcXYd"), ("XY", "c")) == "ab"    # the earliest stop wins
  assert stream_text(TOK, list(b"abc"), ("bcd",)) == "abc"         # a held prefix at the end
  assert stream_text(TOK, list(b"ab") + [TOK.eos_id], ()) == "ab"  # special ids: no text


@pytest.fixture(scope="module")
def engine():
  return Engine(tiny_model(layer_kinds=TWO_LAYERS), max_len=40, prefill_chunk=8, kv_block=8)


@pytest.mark.parametrize("sampling,seed", [(SamplingConfig(), 0),
                                           (SamplingConfig(temperature=1.0, top_p=0.9), 7)])
def test_generate_stream_equals_generate(engine, sampling, seed):
  prompt = np.asarray(random_tokens(3, 1, 19))[0]          # 3 prefill chunks of 8
  want = engine.generate(prompt[None], max_new_tokens=12, sampling=sampling, seed=seed)
  got = list(engine.generate_stream(prompt, max_new_tokens=12, sampling=sampling, seed=seed))
  assert got == want.tokens[0, :want.lengths[0]].tolist()
  # A stop token ends the stream after it (as generate's length counts it).
  stop = got[4]
  cut = list(engine.generate_stream(prompt, max_new_tokens=12, sampling=sampling, seed=seed,
                                    stop_tokens=(stop,)))
  assert cut == got[:got.index(stop) + 1]
  with pytest.raises(ValueError, match="one prompt"):
    next(engine.generate_stream(np.stack([prompt, prompt]), max_new_tokens=2))
  with pytest.raises(ValueError, match="no room"):
    next(engine.generate_stream(np.zeros(40, np.int32), max_new_tokens=2))
