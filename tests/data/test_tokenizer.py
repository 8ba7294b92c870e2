"""Byte tokenizer: exact roundtrip, special ids after the bytes, vocabulary checks, and the
tokenizer contract (roles, token_bytes, make_tokenizer / tokenizer_from_dir for "byte")."""

import numpy as np
import pytest

from hybridmoe_jax.data.tokenizers.base import CHAT_ROLES
from hybridmoe_jax.data.tokenizers.byte import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer
from hybridmoe_jax.data.tokenizers.load import (check_vocab, make_tokenizer, save_tokenizer,
                                                tokenizer_from_dir)


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


def test_byte_tokenizer_meets_the_contract():
  text, vis = ByteTokenizer(), ByteTokenizer(vision=True)
  assert text.special_ids == {"pad": 256, "bos": 257, "eos": 258}
  assert (text.image_start_id, text.image_end_id, text.image_pad_id) == (None, None, None)
  assert vis.special_ids == {"pad": 256, "bos": 257, "eos": 258, "image_start": 259,
                             "image_end": 260, "image_pad": 261}
  assert (vis.image_start_id, vis.image_end_id, vis.image_pad_id) == (259, 260, 261)
  for tok in (text, vis):
    tb = tok.token_bytes()
    assert tb.dtype == np.int32 and tb.shape == (tok.vocab_size,)
    assert tb[:256].tolist() == [1] * 256 and not tb[256:].any()
    s = "héllo ✓ 🚀"
    assert tb[tok.encode(s, bos=True, eos=True)].sum() == len(s.encode("utf-8"))


def test_make_tokenizer_byte_and_dir_without_tokenizer(tmp_path):
  assert isinstance(make_tokenizer("byte"), ByteTokenizer)
  assert make_tokenizer("byte", vision=True).vocab_size == 262
  tok = tokenizer_from_dir(str(tmp_path), vision=True)  # an old workdir: no tokenizer/
  assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 262
  assert isinstance(tokenizer_from_dir(str(tmp_path / "missing")), ByteTokenizer)
  assert save_tokenizer(ByteTokenizer(), str(tmp_path / "t")) == []
  assert not (tmp_path / "t").exists()  # nothing to copy for bytes


def test_chat_roles_are_reserved():
  assert CHAT_ROLES == ("system", "user", "assistant", "tool_call", "tool_result", "answer",
                        "end_turn")


def test_chat_ids_are_opt_in_and_appended_after_the_last_id():
  assert ByteTokenizer().vocab_size == 259 and ByteTokenizer(vision=True).vocab_size == 262
  chat, both = ByteTokenizer(chat=True), ByteTokenizer(vision=True, chat=True)
  assert chat.vocab_size == 266 and both.vocab_size == 269
  assert [chat.special_ids[r] for r in CHAT_ROLES] == list(range(259, 266))
  assert [both.special_ids[r] for r in CHAT_ROLES] == list(range(262, 269))
  # Turning chat on renumbers nothing that existed before.
  assert {k: v for k, v in both.special_ids.items() if k not in CHAT_ROLES} == \
      ByteTokenizer(vision=True).special_ids
  assert (both.image_start_id, both.image_end_id, both.image_pad_id) == (259, 260, 261)
  for tok in (chat, both):
    assert not set(CHAT_ROLES) - set(tok.special_ids)
    tb = tok.token_bytes()
    assert tb.shape == (tok.vocab_size,) and not tb[256:].any()
    ids = np.concatenate([[tok.special_ids["user"]], tok.encode("hé"),
                          [tok.special_ids["end_turn"]]])
    assert tok.decode(ids) == "hé"  # chat ids are specials: dropped by decode
  with pytest.raises(ValueError, match="266"):
    chat.decode([266])
  assert not set(CHAT_ROLES) & set(ByteTokenizer().special_ids)
