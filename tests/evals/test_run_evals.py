"""All tasks end to end on an in-memory tiny model (fast settings), outputs on disk."""

import dataclasses
import json
import os

import numpy as np

from hybridmoe_jax.evals import EvalOptions, run_evals
from hybridmoe_jax.evals.runner import merge_results
from matplotlib import image as mpimg
from tests._support import TWO_LAYERS, tiny_model

# Every engine gets capacity 128 and batch 1, so the tasks share their compilations.
FAST = EvalOptions(prefill_chunk=32, kv_block=32, ppl_max_len=128, ppl_max_docs=2,
                   niah_lengths=(80, 112), niah_depths=(0.0, 1.0), niah_samples=1,
                   niah_digits=2, mqar_lengths=(64, 128), mqar_pairs=(4, 8), mqar_samples=1,
                   prompt="The sky is", max_new_tokens=6, max_len=128)


def test_all_tasks_in_memory(tmp_path):
  lines = []
  results = run_evals(tiny_model(layer_kinds=TWO_LAYERS), ["ppl", "niah", "mqar", "generate"], FAST,
                      str(tmp_path), info={"source": "memory"}, echo=lines.append)
  assert sorted(os.listdir(tmp_path)) == ["generate.json", "mqar.json", "niah.json",
                                          "niah_heatmap.png", "ppl.json", "results.json"]
  p = results["ppl"]
  assert p["documents"] == 2 and p["overall"]["tokens"] == sum(b["tokens"] for b in p["buckets"])
  # An untrained byte model is close to uniform over 259 ids: ~8 bits per byte.
  assert 5 < p["overall"]["bits_per_byte"] < 12 and p["overall"]["ppl"] > 50
  n = results["niah"]
  assert np.array(n["accuracy"]).shape == (2, 2)
  assert mpimg.imread(tmp_path / "niah_heatmap.png").shape[:2] == (350, 500)  # 5 x 3.5 in
  m = results["mqar"]
  assert [(c["length"], c["pairs"]) for c in m["cells"]] == [(64, 4), (64, 8), (128, 4),
                                                             (128, 8)]
  assert all(0 <= c["accuracy"] <= 1 for c in m["cells"])
  g = results["generate"]
  assert 1 <= g["new_tokens"] <= 6 and isinstance(g["text"], str)
  saved = json.load(open(tmp_path / "results.json"))
  assert saved["model"] == {"source": "memory"} and set(saved["results"]) == set(results)
  assert any(line.startswith("== niah") for line in lines)


def test_results_json_merges_later_tasks(tmp_path):
  """A later single task replaces its own result in results.json and keeps the others,
  each with the model and options it ran with; an unreadable file is set aside."""
  fast = dataclasses.replace(FAST, max_new_tokens=2)
  model = tiny_model(layer_kinds=TWO_LAYERS)
  run_evals(model, ["mqar", "generate"], fast, str(tmp_path), info={"step": 10},
            echo=lambda _: None)
  first = json.load(open(tmp_path / "results.json"))
  run_evals(model, ["generate"], dataclasses.replace(fast, prompt="Hi"), str(tmp_path),
            info={"step": 20}, echo=lambda _: None)
  merged = json.load(open(tmp_path / "results.json"))
  assert set(merged["results"]) == {"mqar", "generate"}
  assert merged["results"]["mqar"] == first["results"]["mqar"]
  assert merged["results"]["generate"]["prompt"] == "Hi"
  assert merged["tasks"]["mqar"]["model"] == {"step": 10}
  assert merged["tasks"]["generate"] == {"model": {"step": 20},
                                         "options": merged["options"]}
  assert merged["model"] == {"step": 20} and merged["options"]["prompt"] == "Hi"
  (tmp_path / "results.json").write_text("{not json")
  lines = []
  run_evals(model, ["generate"], fast, str(tmp_path), echo=lines.append)
  assert (tmp_path / "results.json.unreadable").read_text() == "{not json"
  assert set(json.load(open(tmp_path / "results.json"))["results"]) == {"generate"}
  assert any(l.startswith("warning: ") and "unreadable" in l for l in lines)


def test_results_json_from_before_tasks_keeps_its_run(tmp_path):
  old = {"model": {"step": 5}, "options": {"prompt": "x"}, "results": {"ppl": {"v": 1}}}
  (tmp_path / "results.json").write_text(json.dumps(old))
  merged = merge_results(str(tmp_path / "results.json"), {"step": 6}, {"prompt": "y"},
                         {"generate": {"v": 2}})
  assert merged["results"] == {"ppl": {"v": 1}, "generate": {"v": 2}}
  assert merged["tasks"]["ppl"] == {"model": {"step": 5}, "options": {"prompt": "x"}}


def test_generate_never_draws_ids_past_the_tokenizer():
  """A model whose embedding is larger than its tokenizer (an HF checkpoint padded to a
  round vocabulary) must not sample an id the tokenizer cannot decode."""
  from flax import nnx
  from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
  from hybridmoe_jax.evals.runner import run_generate
  from hybridmoe_jax.model.decoder import HybridLM
  from tests._support import tiny_model_config
  tok = ByteTokenizer()
  model = HybridLM(tiny_model_config(num_layers=2, layer_kinds=("kda", "mla"), vocab_size=512),
                   rngs=nnx.Rngs(0))
  # Sampling at temperature 1 from an untrained model: ids past 259 hold half the
  # vocabulary, so without the limit a draw lands there (token 443 at seed 0).
  for seed in range(3):
    opts = dataclasses.replace(FAST, temperature=1.0, max_new_tokens=24, seed=seed)
    g = run_generate(model, opts, tok)
    assert isinstance(g["text"], str) and 1 <= g["new_tokens"] <= 24


def test_results_json_with_tasks_not_an_object_is_set_aside(tmp_path):
  """"tasks" of another type crashed the merge (dict([1])) instead of setting the file
  aside as unreadable."""
  path = tmp_path / "results.json"
  path.write_text(json.dumps({"results": {"ppl": {"v": 1}}, "tasks": [1]}))
  lines = []
  merged = merge_results(str(path), {"step": 6}, {}, {"generate": {"v": 2}}, echo=lines.append)
  assert merged["results"] == {"generate": {"v": 2}}
  assert (tmp_path / "results.json.unreadable").exists() and "unreadable" in lines[0]
