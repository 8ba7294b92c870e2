"""A run with the committed BPE (configs/tokenizers/bundled_bpe1024): finite loss and bits per
byte, the tokenizer copied into the workdir and the evals reading it from there; a vocabulary
larger than the model's stops before the workdir is made."""

import math
import os

import pytest

from hybridmoe_jax.tools import evaluate
from hybridmoe_jax.train.loop import InputError, train_and_evaluate
from hybridmoe_jax.config.run import run_config_from_dict
from tests.conftest import ROOT, load_config, one_device
from tests._support import set_tiny_model

pytest.importorskip("tokenizers", reason="the `tokenizers` extra is not installed")

BPE = str(ROOT / "configs" / "tokenizers" / "bundled_bpe1024")


def _config(vocab_size=1024, steps=2):
  config = load_config("tiny")
  set_tiny_model(config)  # the 2-layer model of the loop tests: one compile, seconds
  config.model.moe.latent_dim = 8
  config.model.vocab_size = vocab_size
  config.data.tokenizer = BPE
  config.train.update(dict(steps=steps, batch_size=2, seq_len=32, warmup=1, log_every=1,
                           eval_every=0, eval_batches=1, checkpoint_every=0,
                           heatmap_every=0, async_checkpoints=False))
  return config


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("bpe") / "w"
  with one_device():
    summary = train_and_evaluate(run_config_from_dict(_config()), str(workdir))
  return workdir, summary


def test_bpe_run_trains_and_reports_bits_per_byte(bpe_run):
  workdir, s = bpe_run
  assert s["end_step"] == 2 and math.isfinite(s["last_loss"])
  ev = s["eval"]
  assert math.isfinite(ev["loss"]) and math.isfinite(ev["bits_per_byte"])
  # Untrained over 1024 ids: ~ln(1024) nats per token; a token is ~3 bytes of held-out text,
  # so bits/byte ~ 10 / 3 (a byte-count bug, e.g. counting tokens as bytes, gives ~10).
  assert 6.0 < ev["loss"] < 8.5 and 1.5 < ev["bits_per_byte"] < 5.0
  # The run is self-contained: the tokenizer file travels with the workdir.
  saved = workdir / "tokenizer" / "tokenizer.json"
  assert saved.read_bytes() == open(os.path.join(BPE, "tokenizer.json"), "rb").read()


def test_evals_read_the_workdir_tokenizer(bpe_run, tmp_path):
  workdir, _ = bpe_run
  lines = []
  opts = dict(ppl_max_len=64, ppl_max_docs=1, prefill_chunk=32, kv_block=32, max_len=64,
              prompt="The sky is", max_new_tokens=3)
  out = evaluate.main(task="ppl", workdir=str(workdir), params=None, output_dir=str(tmp_path),
                      config=None, option_values=opts, echo=lines.append)
  assert any("tokenizer.json (1024 ids)" in ln and str(workdir) in ln for ln in lines)
  ov = out["ppl"]["overall"]
  # 64 BPE tokens cover ~190 bytes (bytes counted by token_bytes, not one per token).
  assert ov["tokens"] == 63 and 2.0 * ov["tokens"] < ov["bytes"] < 5.0 * ov["tokens"]
  assert math.isfinite(ov["bits_per_byte"])
  gen = evaluate.main(task="generate", workdir=str(workdir), params=None,
                      output_dir=str(tmp_path / "g"), config=None, option_values=opts,
                      echo=lines.append)["generate"]
  assert 1 <= gen["new_tokens"] <= 3 and isinstance(gen["text"], str)


def test_vocab_larger_than_the_model_stops_before_the_workdir(tmp_path):
  workdir = tmp_path / "w"
  with pytest.raises(InputError) as e:
    train_and_evaluate(run_config_from_dict(_config(vocab_size=259)), str(workdir))
  msg = str(e.value)
  assert "\n" not in msg and "vocab_size 1024 > model vocab_size 259" in msg
  assert "model.vocab_size >= 1024" in msg and "tokenizer.json" in msg
  assert not workdir.exists()


def test_missing_tokenizer_file_stops_before_the_workdir(tmp_path):
  config = _config()
  config.data.tokenizer = str(tmp_path / "missing.json")
  with pytest.raises(InputError, match=r"^data.tokenizer = .*missing.json.*no such file"):
    train_and_evaluate(run_config_from_dict(config), str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()
