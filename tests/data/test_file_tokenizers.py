"""File tokenizers (tokenizer.json via `tokenizers`, Kimi-format tiktoken files via `tiktoken`)
on tiny files built here: round trips, special roles found by name or added with the same
ids on every load, image ids apart from every real token, token_bytes, one-line errors."""

import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.data.tokenizers import hf
from hybridmoe_jax.data.tokenizers.base import CHAT_ROLES, IMAGE_ROLES, TEXT_ROLES, TokenizerError
from hybridmoe_jax.data.tokenizers.load import (check_vocab, make_tokenizer, save_tokenizer,
                                                tokenizer_from_dir)
from hybridmoe_jax.config.run import DataConfig
from tests.conftest import ROOT

pytest.importorskip("tokenizers", reason="the `tokenizers` extra is not installed")
pytest.importorskip("tiktoken", reason="the `tokenizers` extra is not installed")

TEXTS = ["", "hello world", "héllo wörld ✓ 日本語 🚀", "a\x00b\n\t  x", "x" * 500,
         "The pass key is 48213. Remember it.", "<|im_end|> [BOS] <|image_pad|> <|pad|>"]
CORPUS = ["the cat sat on the mat. the dog ate the hat.", "héllo wörld 日本語 ✓",
          "def f(x):\n    return x + 1\n"] * 20
BASE_SPECIALS = ["<|pad|>", "[BOS]", "<|im_user|>"]  # two found by name, one a role name


def _hf_file(d, *, specials=BASE_SPECIALS, vocab=320):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=vocab, special_tokens=list(specials), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  path = os.path.join(d, "tokenizer.json")
  tok.save(path)
  return path


MERGES = [b"th", b"the", b" the", b"at", b" c", b" cat", b"\xc3\xa9", b"h\xc3\xa9", b"  ",
          b"\xe6\x97\xa5"]


def tiktoken_dir(d, *, config=True, merges=MERGES):
  """256 single bytes + merges, ranks 0..n-1; Kimi-style config naming some specials."""
  os.makedirs(d, exist_ok=True)
  tokens = [bytes([b]) for b in range(256)] + list(merges)
  with open(os.path.join(d, "tiktoken.model"), "w") as f:
    f.writelines(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens))
  n = len(tokens)
  if config:
    named = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 3: "<|im_user|>",
             n + 4: "<|im_assistant|>", n + 6: "<|im_system|>", n + 7: "<|im_middle|>",
             n + 20: "[PAD]"}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
      json.dump({"bos_token": "[BOS]", "eos_token": "[EOS]", "added_tokens_decoder":
                 {str(i): {"content": c, "special": True} for i, c in named.items()}}, f)
  return d


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("tok")
  os.makedirs(root / "hf")
  return {"hf": _hf_file(str(root / "hf")), "tiktoken": tiktoken_dir(str(root / "tk"))}


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip_and_token_bytes(files, kind, text):
  tok = make_tokenizer(files[kind])
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.ndim == 1
  assert tok.decode(ids) == text
  full = tok.encode(text, bos=True, eos=True)
  assert full[0] == tok.bos_id and full[-1] == tok.eos_id and tok.decode(full) == text
  # Special-token text in a document is text: no special id comes out of encode.
  specials = set(tok.special_ids.values())
  assert not specials & set(ids.tolist())
  # bits/byte: the targets' byte counts add up to the text's UTF-8 length.
  assert tok.token_bytes()[full].sum() == len(text.encode("utf-8"))


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_token_bytes_zero_for_specials_and_positive_for_text(files, kind):
  tok = make_tokenizer(files[kind], vision=True)
  tb = tok.token_bytes()
  assert tb.dtype == np.int32 and tb.shape == (tok.vocab_size,)
  assert all(tb[i] == 0 for i in tok.special_ids.values())
  assert tb.max() >= 2  # merges hold several bytes


def test_tiktoken_roles_found_by_name_like_kimi(files):
  tok = make_tokenizer(files["tiktoken"])
  n = 256 + len(MERGES)  # special slots start after the ranks, as in Kimi
  ids = tok.special_ids
  assert (ids["bos"], ids["eos"], ids["pad"]) == (n, n + 1, n + 20)
  assert (ids["end_turn"], ids["user"], ids["assistant"], ids["system"]) == (
      n + 2, n + 3, n + 4, n + 6)
  # Roles Kimi lacks take the unnamed reserved slots in order (n + 5, n + 8, ...).
  assert (ids["tool_call"], ids["tool_result"], ids["answer"]) == (n + 5, n + 8, n + 9)
  assert tok.vocab_size == n + 21  # up to the highest id in use ([PAD])
  assert set(ids) == set(TEXT_ROLES + CHAT_ROLES)
  assert tok.role_names["bos"] == "[BOS]" and tok.role_names["end_turn"] == "<|im_end|>"


def test_hf_roles_found_or_added_consistently(files):
  tok = make_tokenizer(files["hf"])
  ids = tok.special_ids
  assert (ids["pad"], ids["bos"], ids["user"]) == (0, 1, 2)  # the trainer's specials
  from tokenizers import Tokenizer
  hf_size = Tokenizer.from_file(files["hf"]).get_vocab_size()  # <= 320: the corpus is tiny
  added = [ids[r] for r in TEXT_ROLES + CHAT_ROLES if r not in ("pad", "bos", "user")]
  assert added == list(range(hf_size, hf_size + len(added)))  # after the vocabulary, in order
  again = make_tokenizer(os.path.dirname(files["hf"]))
  assert again.special_ids == ids and again.vocab_size == tok.vocab_size


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_vision_adds_image_ids_apart_from_real_tokens(files, kind):
  text, vis = make_tokenizer(files[kind]), make_tokenizer(files[kind], vision=True)
  assert text.image_pad_id is None and text.image_start_id is None
  # The text roles keep their ids; the image roles come on top.
  assert {r: vis.special_ids[r] for r in text.special_ids} == text.special_ids
  image = [vis.image_start_id, vis.image_end_id, vis.image_pad_id]
  assert len(set(image)) == 3 and set(vis.special_ids) == set(text.special_ids) | set(
      IMAGE_ROLES)
  # No id that encoding can produce is an image id: every image id is special...
  assert not set(image) & set(text.special_ids.values())
  assert all(vis.token_bytes()[i] == 0 for i in image)
  special = np.zeros(vis.vocab_size, bool)
  special[list(vis.special_ids.values())] = True
  # ... and text, including the image tokens' own names, never encodes to one.
  for s in TEXTS + ["<|image_start|><|image_pad|><|image_end|><|media_pad|>"]:
    assert not set(image) & set(vis.encode(s).tolist())
  assert vis.decode(np.array(image + [vis.encode("ok")[0]])) == vis.decode(vis.encode("ok")[:1])


def test_special_ids_decoded_away(files):
  tok = make_tokenizer(files["tiktoken"], vision=True)
  ids = np.concatenate([[tok.bos_id], tok.encode("the cat"), [tok.image_pad_id, tok.pad_id,
                                                               tok.eos_id]])
  assert tok.decode(ids) == "the cat"
  with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is outside"):
    tok.decode([tok.vocab_size])


def _one_line(excinfo) -> str:
  msg = str(excinfo.value)
  assert "\n" not in msg and msg
  return msg


def test_errors_are_one_line_and_name_the_file(tmp_path, files):
  missing = str(tmp_path / "nope.json")
  with pytest.raises(TokenizerError) as e:
    make_tokenizer(missing)
  assert "data.tokenizer" in _one_line(e) and missing in str(e.value)
  empty_dir = tmp_path / "empty"
  empty_dir.mkdir()
  with pytest.raises(TokenizerError, match="neither tokenizer.json nor tiktoken.model") as e:
    make_tokenizer(str(empty_dir))
  _one_line(e)
  bad_json = tmp_path / "bad.json"
  bad_json.write_text('{"model": ')
  with pytest.raises(TokenizerError, match="not a valid Hugging Face tokenizer.json") as e:
    make_tokenizer(str(bad_json))
  assert str(bad_json) in _one_line(e)
  bad_tk = tmp_path / "bad.model"
  bad_tk.write_text("YQ== 0\nnot base64! 1\n")
  with pytest.raises(TokenizerError, match="line 2") as e:
    make_tokenizer(str(bad_tk))
  assert str(bad_tk) in _one_line(e)
  no_bytes = tiktoken_dir(str(tmp_path / "nobytes"), config=False, merges=[])
  lines = open(os.path.join(no_bytes, "tiktoken.model")).read().splitlines()
  with open(os.path.join(no_bytes, "tiktoken.model"), "w") as f:  # drop byte 0, renumber
    f.write("\n".join(f"{ln.split()[0]} {i}" for i, ln in enumerate(lines[1:])) + "\n")
  with pytest.raises(TokenizerError, match="lacks 1 single-byte tokens") as e:
    make_tokenizer(no_bytes)
  _one_line(e)


def test_missing_named_special_token_is_an_error(tmp_path):
  d = tiktoken_dir(str(tmp_path / "tk"))
  cfg_path = os.path.join(d, "tokenizer_config.json")
  cfg = json.load(open(cfg_path))
  cfg["bos_token"] = {"content": "<|begin_of_text|>"}  # not a token of this vocabulary
  json.dump(cfg, open(cfg_path, "w"))
  with pytest.raises(TokenizerError, match="bos_token '<|begin_of_text|>' is not a token") as e:
    make_tokenizer(d)
  assert cfg_path in _one_line(e)


def test_vocab_larger_than_the_model_names_both_sizes(files):
  tok = make_tokenizer(files["hf"])
  check_vocab(tok, tok.vocab_size)
  with pytest.raises(ValueError) as e:
    check_vocab(tok, 259)
  msg = _one_line(e)
  assert files["hf"] in msg and f"vocab_size {tok.vocab_size} > model vocab_size 259" in msg
  assert f"model.vocab_size >= {tok.vocab_size}" in msg


def test_missing_package_names_the_extra(files, monkeypatch):
  monkeypatch.setitem(sys.modules, "tiktoken", None)  # import fails
  with pytest.raises(TokenizerError, match=r"hybridmoe_jax\[tokenizers\]") as e:
    make_tokenizer(files["tiktoken"])
  _one_line(e)


def test_tokenizer_libraries_load_lazily():
  code = ("import sys, hybridmoe_jax.ops, hybridmoe_jax.data.tokenizers.load as t; "
          "t.make_tokenizer('byte'); "
          "assert not {'tokenizers', 'tiktoken'} & set(sys.modules), sys.modules.keys()")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_save_copies_and_refuses_another_tokenizer(tmp_path, files):
  tok = make_tokenizer(files["tiktoken"])
  out = tmp_path / "w" / "tokenizer"
  saved = save_tokenizer(tok, str(out))
  assert sorted(os.listdir(out)) == ["tiktoken.model", "tokenizer_config.json"] and saved
  assert save_tokenizer(tok, str(out)) == saved  # identical files: kept
  back = tokenizer_from_dir(str(out), vision=True)
  assert back.special_ids == make_tokenizer(files["tiktoken"], vision=True).special_ids
  with pytest.raises(TokenizerError, match="already holds tiktoken.model") as e:
    save_tokenizer(make_tokenizer(files["hf"]), str(out))
  _one_line(e)
  other = tiktoken_dir(str(tmp_path / "other"), merges=MERGES[:3])
  with pytest.raises(TokenizerError, match="holds another tokenizer") as e:
    save_tokenizer(make_tokenizer(other), str(out))
  _one_line(e)
  assert len(open(out / "tiktoken.model").read().splitlines()) == 256 + len(MERGES)


def test_data_config_field():
  assert DataConfig().tokenizer == "byte"
  assert DataConfig(tokenizer="configs/tokenizers/x").tokenizer == "configs/tokenizers/x"
  for bad in ("", " x", 3):
    with pytest.raises(ConfigError, match="data.tokenizer"):
      DataConfig(tokenizer=bad)


def test_bundled_bpe_example():
  """The committed BPE: 1024 ids, roles first, exact round trip and bytes on held-out text."""
  path = str(ROOT / "configs" / "tokenizers" / "bundled_bpe1024")
  tok = make_tokenizer(path, vision=True)
  assert tok.vocab_size == 1024 and isinstance(tok, hf.HFTokenizer)
  assert [tok.special_ids[r] for r in TEXT_ROLES + CHAT_ROLES + IMAGE_ROLES] == list(range(13))
  text = "Return the value of x. héllo ✓\n\n    for i in range(10):"
  ids = tok.encode(text)
  assert tok.decode(ids) == text and tok.token_bytes()[ids].sum() == len(text.encode())
  assert len(ids) < len(text.encode()) / 2  # it compresses English and code


def test_train_bpe_script(tmp_path, capsys):
  from hybridmoe_jax.data.tokenizers import train_bpe
  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(4):
    (docs / f"{i}.txt").write_text(" ".join(CORPUS[i:i + 3]))
  out = tmp_path / "bpe"
  args = ["--out", str(out), "--vocab_size", "300", "--source", "text", "--paths", str(docs)]
  assert train_bpe.main(args) == 0
  tok = make_tokenizer(str(out), vision=True)
  assert [tok.special_ids[r] for r in TEXT_ROLES + CHAT_ROLES + IMAGE_ROLES] == list(range(13))
  assert tok.decode(tok.encode(CORPUS[0])) == CORPUS[0]
  before = (out / "tokenizer.json").read_bytes()
  assert train_bpe.main(args) == 1  # never overwrites
  assert "already holds tokenizer.json" in capsys.readouterr().err
  assert (out / "tokenizer.json").read_bytes() == before
  assert train_bpe.main(["--out", str(tmp_path / "small"), "--vocab_size", "100"]) == 1
  assert "allowed >= 269" in capsys.readouterr().err


def test_tiny_bpe_preset_fits_its_tokenizer():
  from hybridmoe_jax.config.run import run_config_from_dict
  from tests.conftest import load_config
  run = run_config_from_dict(load_config("tiny_bpe"))
  tok = make_tokenizer(run.data.tokenizer)
  check_vocab(tok, run.model.vocab_size)
  assert tok.vocab_size == run.model.vocab_size == 1024


def test_superscript_special_id_is_a_tokenizer_error(tmp_path):
  """"²".isdigit() is True but int("²") raises: the key passed the check and failed as a bare
  ValueError naming no file."""
  d = tiktoken_dir(str(tmp_path / "tk"))
  cfg_path = os.path.join(d, "tokenizer_config.json")
  cfg = json.load(open(cfg_path))
  cfg["added_tokens_decoder"]["\u00b2"] = {"content": "[X]", "special": True}
  json.dump(cfg, open(cfg_path, "w"))
  with pytest.raises(TokenizerError, match="added_tokens_decoder entry '\u00b2'") as e:
    make_tokenizer(d)
  assert cfg_path in _one_line(e)
