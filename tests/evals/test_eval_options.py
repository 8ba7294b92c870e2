"""run_eval's bad flag values fail before the model loads; stage NIAH grids written atomically."""

import json
import os
import types

import pytest

from hybridmoe_jax.evals import niah, runner, stage_niah
from hybridmoe_jax.tools import evaluate


@pytest.mark.parametrize("values, flag", [
    (dict(ppl_max_len=1), "ppl_max_len"),
    (dict(seed=-1), "seed"),
    (dict(ruler_seed=-5), "ruler_seed"),
    (dict(vqa_seed=-7), "vqa_seed"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=2.0), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(mqar_pairs=["100"], mqar_lengths=["512"]), "mqar_pairs"),
    (dict(mqar_pairs=["16"], mqar_lengths=["8", "32"]), "mqar_lengths"),
])
def test_bad_values_rejected_before_any_model(values, flag):
  with pytest.raises(ValueError, match=f"--{flag}"):
    runner.options_from_flags(values)


def test_good_edge_values_accepted():
  opts = runner.options_from_flags(dict(ppl_max_len=2, seed=0, ruler_seed=-1, vqa_seed=-1,
                                        top_p=1.0, mqar_pairs=["85"], mqar_lengths=["340"]))
  assert opts.ppl_max_len == 2 and opts.mqar_pairs == (85,)


class _WideTokenizer:
  """Two ids per character: the needle and question need twice the byte prompt length."""
  name, vocab_size, bos_id = "wide", 512, 1

  def encode(self, text, bos=False, eos=False):
    return [0] * (2 * len(text))


def test_niah_length_checked_in_the_runs_tokenizer_before_any_task(monkeypatch, tmp_path):
  ran = []
  model = types.SimpleNamespace(cfg=types.SimpleNamespace(
      vision=types.SimpleNamespace(enabled=False), num_layers=1, layer_kinds=("attention",)),
                                compute=None)
  monkeypatch.setattr(evaluate, "load_model", lambda **_: (model, {}))
  monkeypatch.setattr(evaluate, "tokenizer_from_dir", lambda *a, **k: _WideTokenizer())
  monkeypatch.setattr(evaluate, "describe_impls", lambda *a: [])
  monkeypatch.setattr(evaluate, "run_evals", lambda *a, **k: ran.append(a[1]) or {})
  length = niah.min_length(5)    # enough for bytes, too short for the wide tokenizer
  with pytest.raises(ValueError, match="--niah_lengths"):
    evaluate.main(task="all", workdir=str(tmp_path), params=None, output_dir=None,
                  config=None, option_values={"niah_lengths": [str(length)]}, echo=print)
  assert not ran


def test_stage_niah_grid_is_never_half_written(monkeypatch, tmp_path):
  """A write killed inside json.dump leaves no truncated niah_stage<k>.json."""
  grid = {"lengths": [128], "depths": [0.0], "accuracy": [[0.0]], "digit_accuracy": [[0.0]],
          "mean_accuracy": 0.0, "samples": 1, "chance": 1e-5}
  monkeypatch.setattr(stage_niah, "Engine", lambda *a, **k: None)
  monkeypatch.setattr(stage_niah.niah, "evaluate_niah", lambda *a, **k: dict(grid))
  s = stage_niah.StageNiah(str(tmp_path), [128], [0.0], samples=1,
                           tokenizer=niah.ByteTokenizer())
  stage = types.SimpleNamespace(seq_len=64, index=0, name="s0")

  def killed(obj, f, **_):
    f.write('{"lengths": [')
    raise KeyboardInterrupt

  monkeypatch.setattr(json, "dump", killed)
  with pytest.raises(KeyboardInterrupt):
    s(1, stage, None)
  path = os.path.join(str(tmp_path), "niah_stage0.json")
  assert not os.path.exists(path)
  monkeypatch.undo()
  monkeypatch.setattr(stage_niah, "Engine", lambda *a, **k: None)
  monkeypatch.setattr(stage_niah.niah, "evaluate_niah", lambda *a, **k: dict(grid))
  s(1, stage, None)
  with open(path, encoding="utf-8") as f:
    assert json.load(f)["stage"] == 0
