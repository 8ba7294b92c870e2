"""hybridmoe_jax.load: each layout, generate / score / forward against the engine and the
model called directly, cache sizes, sharding over 8 simulated devices, one-line errors.

One real run (2 steps of a 2-layer MLA model, exported at the end) serves every test: what
is checked here is the wrapping (layouts, ragged batches, scoring arithmetic, placement), not
the mixers, which tests/infer checks on the hybrid models.
"""

import copy
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hybridmoe_jax
from hybridmoe_jax import api, loading
from hybridmoe_jax.data.tokenizers.base import TokenizerError
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.infer import Engine, cache_bytes, init_cache
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.parallel.mesh import build_mesh
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests.conftest import load_config, one_device
from tests._support import tiny_model_config
from tests.infer.helpers import full_logits
from tests._support import set_tiny_model

PROMPTS = ["The ", "A longer prompt here", "Hi"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(workdir, params export) of a 2-step run of a 2-layer MLA model over bytes."""
  root = tmp_path_factory.mktemp("api")
  config = load_config("tiny")            # the chat byte vocabulary (byte_chat, 266)
  set_tiny_model(config)
  config.model.moe.latent_dim = 8
  config.train.update(dict(steps=2, batch_size=2, seq_len=32, warmup=1, log_every=1,
                           eval_every=0, eval_batches=1, checkpoint_every=0, heatmap_every=0,
                           async_checkpoints=False))
  with one_device():
    train_and_evaluate(run_config_from_dict(config), str(root / "w"),
                       export_params_to=str(root / "export"))
  return str(root / "w"), str(root / "export")


@pytest.fixture(scope="module")
def lm(run):
  return api.load(run[1], max_len=64, prefill_chunk=16, kv_block=16)


TEXTS = ["Hello world", "Hi"]


@pytest.fixture(scope="module")
def ref(lm):
  """(tokens [2, 12], logits [2, 12, V]) of TEXTS by the model's own jitted forward, the
  short row padded at the end (causal: its real positions are unchanged)."""
  tok = ByteTokenizer()
  rows = [tok.encode(t, bos=True) for t in TEXTS]
  tokens = np.zeros((2, len(rows[0])), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  return rows, np.asarray(full_logits(lm.model, jnp.asarray(tokens)))


def test_each_layout_loads_the_same_weights_and_forward_is_the_model(run, lm, ref):
  assert hybridmoe_jax.load is api.load and hybridmoe_jax.LoadedModel is api.LoadedModel
  from_workdir = api.load(run[0], max_len=64)
  assert from_workdir.info["layout"] == "workdir" and from_workdir.info["step"] == 2
  assert lm.info["layout"] == "params" and isinstance(lm.tokenizer, ByteTokenizer)
  assert lm.config == from_workdir.config
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(lm.model)),
               nnx.to_pure_dict(nnx.state(from_workdir.model)))
  # Ragged texts are right-padded as padding: each row's logits are its own forward's.
  rows, want = ref
  logits = lm.forward(TEXTS)
  assert logits.shape == (2, len(rows[0]), lm.config.vocab_size)
  for i, r in enumerate(rows):
    np.testing.assert_allclose(logits[i, :len(r)], want[i, :len(r)], rtol=1e-5, atol=1e-5)


def test_generate_ragged_batch_equals_engine_per_prompt(lm):
  got = lm.generate(PROMPTS, max_new_tokens=6)
  assert isinstance(got, list) and len(got) == 3
  engine = Engine(lm.model, max_len=64, prefill_chunk=16, kv_block=16)
  tok = lm.tokenizer
  for prompt, text in zip(PROMPTS, got):
    out = engine.generate(tok.encode(prompt, bos=True)[None], max_new_tokens=6,
                          stop_tokens=(tok.eos_id,), pad_id=tok.pad_id)
    ids = out.tokens[0, :out.lengths[0]]
    assert text == tok.decode(ids[ids != tok.eos_id])
  assert lm.generate(PROMPTS[1], max_new_tokens=6) == got[1]     # one prompt -> one str
  # Stop strings cut the text; sampling runs with a seed and is reproducible.
  cut = next((c for c in got[0][1:] if c.strip()), None)
  if cut is not None:
    assert lm.generate(PROMPTS[0], max_new_tokens=6, stop=cut) == got[0][:got[0].index(cut)]
  hot = dict(max_new_tokens=6, temperature=1.0, top_k=20, seed=3)
  assert lm.generate(PROMPTS, **hot) == lm.generate(PROMPTS, **hot)


def test_chat_renders_like_the_server_and_answers_until_end_turn(lm):
  """lm.chat renders the conversation exactly as /v1/chat/completions does (the server's
  own parser and chat_format.render) and shows the greedy reply up to <end_turn> / EOS /
  <tool_call>, special ids left out."""
  from hybridmoe_jax.serve.protocol import parse_chat  # pylint: disable=import-outside-toplevel
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sky?"}]
  reply = lm.chat(messages, max_new_tokens=12)
  tok, roles = lm.tokenizer, chat_format.chat_ids(lm.tokenizer)
  served = parse_chat({"model": "m", "messages": messages}).messages
  ids = chat_format.render(tok, list(served), add_generation_prompt=True).ids
  assert ids.tolist() == chat_format.render(tok, api.chat_messages(messages),
                                            add_generation_prompt=True).ids.tolist()
  # The reference: greedy decoding one token at a time over the full forward (padded at the
  # end to one width: causal, so the last real position's logits are unchanged).
  seq, special = ids.tolist(), set(tok.special_ids.values())
  for _ in range(12):
    row = np.full((1, 64), tok.pad_id, np.int32)
    row[0, :len(seq)] = seq
    nxt = int(np.argmax(full_logits(lm.model, row)[0, len(seq) - 1]))
    if nxt in (roles["end_turn"], tok.eos_id, roles["tool_call"]):
      break
    seq.append(nxt)
  assert reply == tok.decode([t for t in seq[len(ids):] if t not in special])
  with pytest.raises(ValueError, match=r"messages\[1\]\.role = 'bot' is invalid"):
    lm.chat([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}])
  with pytest.raises(ValueError, match="messages must be a non-empty list"):
    lm.chat("Hi")


def test_chat_without_chat_roles_names_the_training_flags(lm):
  plain = copy.copy(lm)
  plain.tokenizer = ByteTokenizer()
  with pytest.raises(TokenizerError, match="--config.data.tokenizer=byte_chat "
                                           "--config.model.vocab_size=266"):
    plain.chat([{"role": "user", "content": "Hi"}])


def test_score_is_the_log_softmax_of_the_forward(lm, ref):
  rows, logits = ref
  scores = lm.score(TEXTS)
  for i, (text, s) in enumerate(zip(TEXTS, scores)):
    tokens = rows[i]
    logp = np.asarray(jax.nn.log_softmax(logits[i, :len(tokens)]))
    want = logp[np.arange(len(tokens) - 1), tokens[1:]]
    np.testing.assert_array_equal(s.tokens, tokens)
    np.testing.assert_allclose(s.logprobs, want, rtol=1e-4, atol=1e-4)
    assert s.nll == pytest.approx(-want.sum(), rel=1e-4)
    assert s.perplexity == pytest.approx(math.exp(-want.mean()), rel=1e-4)
    assert s.num_bytes == len(text.encode())
    assert s.bits_per_byte == pytest.approx(-want.sum() / math.log(2) / len(text), rel=1e-4)
  assert lm.score(TEXTS[1]).nll == pytest.approx(scores[1].nll, rel=1e-6)
  with_eos = lm.score(TEXTS[1], eos=True)
  assert len(with_eos.logprobs) == 3 and with_eos.num_bytes == 2


def test_forward_cache_continues_with_decode(lm, ref):
  rows, want = ref
  logits, cache = lm.forward("Hello", return_cache=True)
  assert int(cache.length[0]) == 6 and cache.max_len == lm.max_len
  np.testing.assert_allclose(logits[0], want[0, :6], rtol=1e-4, atol=1e-4)
  step, _ = lm.engine.decode_step(jnp.asarray([ord(" ")]), cache)    # "Hello" + " "
  np.testing.assert_allclose(step[0], want[0, 6], rtol=1e-4, atol=1e-4)


def test_cache_bytes_kda_constant_mla_linear():
  # One KDA and one MLA layer, abstract: sizes come from shapes, nothing is allocated.
  cfg = tiny_model_config(num_layers=2, layer_kinds=("kda", "mla"))
  model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
  lm = api.LoadedModel(model, ByteTokenizer(), {}, max_len=128)
  a, b = lm.cache_bytes(1024), lm.cache_bytes(2048)
  assert a["kda"] == b["kda"] > 0 and b["mla"] == 2 * a["mla"] > 0
  assert a["mla"] == 1024 * a["mla_per_token"] and a["total"] == a["kda"] + a["mla"]
  real = cache_bytes(init_cache(model.cfg, 2, 128))         # allocated
  assert {k: lm.cache_bytes(batch=2)[k] for k in real} == real


def test_sharded_score_and_generate_equal_one_device(run, lm, monkeypatch):
  mesh = build_mesh({"fsdp": 2, "expert": 2, "tensor": 2}, devices=jax.devices())
  sharded = api.load(run[1], mesh=mesh, max_len=64, prefill_chunk=16, kv_block=16)
  spans = {len(x.sharding.device_set) for x in jax.tree.leaves(sharded.engine.state)}
  assert 8 in spans, spans                        # some parameters really are split
  experts = sharded.model.layers[1].ffn.w_up[...].sharding.spec
  assert experts[0] == "expert", experts           # the routed experts over `expert`
  for s, u in zip(sharded.score(TEXTS), lm.score(TEXTS)):
    np.testing.assert_allclose(s.logprobs, u.logprobs, rtol=1e-5, atol=1e-5)
  assert sharded.generate(PROMPTS, max_new_tokens=6) == lm.generate(PROMPTS, max_new_tokens=6)
  # "auto": every device on fsdp.
  monkeypatch.setattr("hybridmoe_jax.parallel.mesh.available_devices", jax.devices)
  assert dict(api._resolve_mesh("auto").shape)["fsdp"] == 8


def test_bfloat16_compute_keeps_float32_params(run, lm):
  half = api.load(run[1], dtype="bfloat16", max_len=64)
  assert half.model.compute.dtype == "bfloat16"
  assert half.model.embed.embedding[...].dtype == jnp.float32
  a, b = np.asarray(half.forward("Hello")), np.asarray(lm.forward("Hello"))
  assert np.abs(a - b).max() < 0.1 * np.abs(b).max()


def test_one_line_errors_before_compute(run, lm, tmp_path):
  def fails(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match) as e:
      fn(*args, **kwargs)
    assert "\n" not in str(e.value)

  fails(FileNotFoundError, "does not exist", api.load, str(tmp_path / "nope"))
  (tmp_path / "notes.txt").write_text("x")
  fails(ValueError, "none of the known layouts.*checkpoints/.*safetensors", api.load,
        str(tmp_path))
  fails(ValueError, "is a file", api.load, str(tmp_path / "notes.txt"))
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text("{}")
  (hf / "model.safetensors").write_bytes(b"")
  assert loading.detect_layout(str(hf)) == "hf"
  fails(ValueError, "model_type. = None .*kimi_linear", api.load, str(hf))  # not Kimi-Linear
  fails(ValueError, "mesh='all'", api.load, run[1], mesh="all")
  fails(ValueError, "dtype='fp8'", api.load, run[1], dtype="fp8")
  fails(ValueError, "max_len=0", api.load, run[1], max_len=0)
  fails(ValueError, "token id 300, outside the vocabulary", lm.generate, [1, 300])
  fails(ValueError, r"prompt\[1\] holds token id -1", lm.generate, [[1, 2], [-1]])
  fails(ValueError, "60 new tokens exceed the cache capacity max_len=64", lm.generate,
        "Hello", max_new_tokens=60)
  fails(ValueError, "max_new_tokens=0", lm.generate, "Hello", max_new_tokens=0)
  fails(ValueError, "empty string", lm.generate, "")
  fails(ValueError, r"prompt\[1\] is empty", lm.generate, [[1, 2], []])
  fails(ValueError, "empty list", lm.score, [])
  fails(ValueError, "exceed the cache capacity", lm.score, "x" * 100)
  fails(ValueError, "at least 2", lm.score, [257])
  fails(ValueError, "shape", lm.forward, np.zeros((1, 2, 3), np.int32))
  fails(ValueError, "max_len=0", lm.cache_bytes, 0)


def test_hugging_face_dir_loads_with_its_tiktoken_tokenizer(tmp_path):
  """A Kimi-Linear HF dir (weights + Kimi-format tiktoken files) loads through `load`: the
  model is the converter's, the tokenizer the dir's own, and text goes in and out."""
  pytest.importorskip("tiktoken", reason="the `tokenizers` extra is not installed")
  from hybridmoe_jax.loading import load_hf_model
  from hybridmoe_jax.data.tokenizers.load import make_tokenizer
  from tests.convert.kimi_tiny import tiny_hf_config, write_hf_dir
  from tests.data.test_file_tokenizers import tiktoken_dir
  hf = write_hf_dir(tmp_path / "hf", tiny_hf_config(vocab_size=300), shards=1)
  tiktoken_dir(hf)  # 266 BPE ranks + Kimi-style named specials: every id < 300
  lm = api.load(hf, max_len=64, prefill_chunk=16, kv_block=16)
  assert lm.info["source"] == "huggingface"
  assert lm.tokenizer.vocab_size == make_tokenizer(hf).vocab_size <= 300
  assert lm.tokenizer.bos_id != ByteTokenizer().bos_id     # the file's [BOS], not ours
  model, _ = load_hf_model(hf)
  ids = lm.tokenizer.encode("the cat sat", bos=True)[None]
  want = full_logits(model, jnp.asarray(ids))
  np.testing.assert_allclose(np.asarray(lm.forward("the cat sat")), np.asarray(want),
                             rtol=1e-5, atol=1e-5)
  out = lm.generate("the cat", max_new_tokens=4)
  assert isinstance(out, str)
  score = lm.score("the cat sat on the mat")
  assert np.isfinite(score.nll) and score.bits_per_byte > 0


def test_score_of_ids_past_the_byte_vocabulary_in_a_tokenizerless_hf_dir(tmp_path):
  """An HF dir without tokenizer files is read with the byte tokenizer (259 ids) while its
  embedding has 300 rows: scoring ids >= 259 works (they stand for 0 bytes) and equals
  the same ids' nll from the engine, instead of failing in the byte decoder."""
  from tests.convert.kimi_tiny import tiny_hf_config, write_hf_dir
  hf = write_hf_dir(tmp_path / "hf", tiny_hf_config(vocab_size=300), shards=1)
  lm = api.load(hf, max_len=32, prefill_chunk=8, kv_block=8)
  assert isinstance(lm.tokenizer, ByteTokenizer) and lm.config.vocab_size == 300
  ids = [ByteTokenizer.bos_id, 65, 280, 299, 66]
  got = lm.score(ids)
  nll, _ = lm.engine.score(np.asarray([ids]))
  assert got.num_bytes == 2                     # "A" and "B"; 280 and 299 are not text
  np.testing.assert_allclose(got.logprobs, -nll[0], rtol=1e-6)
  assert math.isclose(got.bits_per_byte, got.nll / math.log(2) / 2, rel_tol=1e-9)
  assert lm.score([ids, ids[:3]])[1].num_bytes == 1


def test_a_gs_path_loads_from_its_local_mirror(run, monkeypatch):
  """`load("gs://...")` detects the layout of the run's or export's local mirror
  (loading.local_dir, as loading.load reads it), not of the URL, which is no local path."""
  from hybridmoe_jax.data import storage
  urls = {"gs://bucket/export": run[1]}
  monkeypatch.setattr(storage, "mirror", lambda url, *_, **__: urls[url])
  lm = api.load("gs://bucket/export", max_len=16, prefill_chunk=8, kv_block=8)
  assert lm.info["layout"] == "params" and lm.info["path"] == run[1]
  with pytest.raises(FileNotFoundError, match="does not exist"):
    api.load(str(run[1]) + "-missing")


def test_a_dir_named_with_glob_characters_is_detected(tmp_path):
  """A Hugging Face dir whose path holds [ ] * ? is still recognised by its files."""
  for name in ("run[v2]", "a*b?"):
    hf = tmp_path / name
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert loading.detect_layout(str(hf)) == "hf", name


def test_chat_messages_with_a_list_role_is_a_value_error():
  with pytest.raises(ValueError, match=r"messages\[0\]\.role = \['user'\] is invalid"):
    api.chat_messages([{"role": ["user"], "content": "x"}])


def test_an_export_whose_tensor_names_clash_is_a_value_error(tmp_path):
  """A damaged params.safetensors holding both "x" and "x/extra" is refused with a
  ValueError naming the tensor (not an IndexError from inside the name nesting)."""
  from hybridmoe_jax.io import safetensors
  from hybridmoe_jax.train.params_export import PARAMS_FILE
  from tests.serve.fixtures import write_chat_model
  path = write_chat_model(tmp_path)
  file = f"{path}/{PARAMS_FILE}"
  with safetensors.SafetensorsFile(file) as f:
    tensors = {name: f.read(name) for name in f.tensors}
  first = next(iter(tensors))
  tensors[first + "/extra"] = np.zeros(2, np.float32)
  os.remove(file)
  writer = safetensors.SafetensorsWriter(file, [
      safetensors.Spec(n, safetensors.dtype_code(x.dtype), x.shape) for n, x in tensors.items()])
  for name, x in tensors.items():
    writer.write(name, [x])
  writer.close()
  with pytest.raises(ValueError, match=f"tensor '{first}/extra': its name .* prefix"):
    api.load(path)
