"""Byte tokenizer: exact roundtrip, special ids after the bytes, vocabulary checks."""

import numpy as np
import pytest

from hybridmoe_jax.data import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer, check_vocab


TEXTS = ["", "hello", "héllo wörld ✓ 日本語 🚀", "a\x00b\n\t", "x" * 1000]


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.shape == (len(text.encode("utf-8")),)
  assert tok.decode(ids) == text
  assert tok.decode(tok.encode(text, bos=True, eos=True)) == text


def test_special_ids_follow_the_bytes():
  tok = ByteTokenizer()
  assert tok.vocab_size == 259
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (PAD_ID, BOS_ID, EOS_ID) == (256, 257, 258)
  ids = tok.encode("\x00", bos=True, eos=True)
  np.testing.assert_array_equal(ids, [257, 0, 258])  # NUL is byte 0, never padding


def test_decode_drops_specials_and_replaces_cut_characters():
  tok = ByteTokenizer()
  ids = np.concatenate([[BOS_ID], tok.encode("ab"), [PAD_ID, PAD_ID, EOS_ID]])
  assert tok.decode(ids) == "ab"
  cut = tok.encode("é")[:1]  # first byte of a two-byte character
  assert tok.decode(np.concatenate([tok.encode("a"), cut])) == "a\ufffd"
  assert tok.decode(np.array([[104, 105]])) == "hi"  # any shape is flattened


@pytest.mark.parametrize("bad", [259, -1, 10_000])
def test_decode_rejects_ids_outside_vocab(bad):
  with pytest.raises(ValueError, match=str(bad)):
    ByteTokenizer().decode([104, bad])


def test_check_vocab():
  check_vocab(ByteTokenizer(), 259)
  check_vocab(ByteTokenizer(), 163840)
  with pytest.raises(ValueError, match=r"tokenizer vocab_size 259 > model vocab_size 256"):
    check_vocab(ByteTokenizer(), 256)
