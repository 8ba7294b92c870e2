"""The RULER-style suite: prompts of exact token length whose answers a slow recount of the
decoded prompt confirms; scoring and intervals; the task end to end on a tiny model, on a
params export through run_eval's CLI, and on a converted Kimi-Linear checkpoint."""

import collections
import json
import os
import re

import numpy as np
import pytest
from matplotlib import image as mpimg

from hybridmoe_jax.convert import convert
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.data.tokenizers.load import tokenizer_from_dir
from hybridmoe_jax.evals import EvalOptions, report, run_evals, ruler, ruler_tasks, ruler_text
from hybridmoe_jax.tools.evaluate import main
from tests.convert.kimi_tiny import tiny_hf_config, write_hf_dir
from tests.conftest import ROOT
from tests._support import TWO_LAYERS, tiny_model

BYTES = ByteTokenizer()
BPE_DIR = os.path.join(ROOT, "configs", "tokenizers", "bundled_bpe1024")


_SHAPES = {"words": r"[a-z]{4,12}-[a-z]{4,12}", "digits": r"[1-9]\d{6}",
           "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"}


def _text(tok, ex):
  assert ex.prompt[0] == tok.bos_id
  return tok.decode(ex.prompt[1:])


@pytest.mark.parametrize("task", ruler.TASKS)
def test_every_task_hits_the_length_exactly_bytes_and_bpe(task):
  bpe = tokenizer_from_dir(BPE_DIR)
  rng = np.random.default_rng(0)
  for tok in (BYTES, bpe):
    for n in (1024, 3000):
      ex = ruler_tasks.make_example(task, rng, n, tok)
      assert ex.prompt.dtype == np.int32 and ex.prompt.shape == (n,)
      assert ex.answers and all(ex.answers)


@pytest.mark.parametrize("task", [t for t, s in ruler_tasks.TASKS.items() if s.family == "niah"])
def test_niah_answers_and_distractors_are_where_the_text_says(task):
  """Slow reference: parse the decoded prompt's needles and recompute the answer."""
  spec = ruler_tasks.TASKS[task]
  ex = ruler_tasks.make_example(task, np.random.default_rng(1), 2048, BYTES)
  text = _text(BYTES, ex)
  needles = re.findall(r"One special \w+ for (\S+) is (\S+)\. ", text)
  assert len(needles) == spec.needles * spec.values_per_key
  keys = list(dict.fromkeys(k for k, _ in needles))
  assert len(keys) == spec.needles                       # distractor keys, same shape
  assert all(re.fullmatch(_SHAPES[spec.keys], k) for k in keys)
  assert all(re.fullmatch(_SHAPES[spec.values], v) for _, v in needles)
  asked = re.search(r"\? The special \w+ for (.+) (?:is|are) $", text).group(1)
  asked = re.split(r", | and ", asked)
  assert len(asked) == spec.queries
  want = [v for k, v in needles if k in asked]
  assert sorted(ex.answers) == sorted(want)
  for v in ex.answers:                                   # each value written exactly once
    assert text.count(v) == 1


def test_haystack_keeps_its_numbers():
  """Natural text with numbers in it: the digit answer is not the only number."""
  text = _text(BYTES, ruler_tasks.make_example("niah_single", np.random.default_rng(3), 8192,
                                               BYTES))
  assert len(re.findall(r"\d+", text)) > 5


def test_vt_chain_is_in_order_and_complete():
  ex = ruler_tasks.make_example("vt", np.random.default_rng(2), 2048, BYTES)
  text = _text(BYTES, ex)
  value = re.search(r"assigned the value (\d+) are $", text).group(1)
  first = re.findall(rf"VAR ([A-Z]{{5}}) = {value}\. ", text)
  chain = list(first)
  for _ in range(10):
    nxt = re.findall(rf"VAR ([A-Z]{{5}}) = VAR {chain[-1]}\. ", text)
    if not nxt:
      break
    assert text.index(f"VAR {nxt[0]} = VAR {chain[-1]}") > text.index(f"VAR {chain[-1]} =")
    chain += nxt
  assert tuple(chain) == ex.answers and len(chain) == ruler_tasks.TASKS["vt"].hops + 1


@pytest.mark.parametrize("n", [1024, 8192])
def test_cwe_answers_are_the_most_common_words(n):
  spec = ruler_tasks.TASKS["cwe"]
  ex = ruler_tasks.make_example("cwe", np.random.default_rng(4), n, BYTES)
  items = re.findall(r"(\d+)\. ([a-z]+) ", _text(BYTES, ex).split("numbered list")[1])
  assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
  counts = collections.Counter(w for _, w in items).most_common()
  assert {w for w, _ in counts[:spec.common]} == set(ex.answers)
  assert counts[spec.common - 1][1] > counts[spec.common][1] if len(counts) > spec.common else True


def test_fwe_answers_are_the_three_most_frequent_coded_words():
  ex = ruler_tasks.make_example("fwe", np.random.default_rng(5), 4096, BYTES)
  body = _text(BYTES, ex).split("appears.\n")[1].split("\nWhat are")[0]
  counts = collections.Counter(body.split()).most_common()
  assert tuple(w for w, _ in counts[:3]) == ex.answers and counts[2][1] > counts[3][1]


def test_scoring_and_wilson():
  assert ruler_tasks.string_match_all("It is 123 and ABC.", ["123", "abc", "9"]) == 2 / 3
  lo, hi = ruler.wilson(5, 10)
  np.testing.assert_allclose([lo, hi], [0.2366, 0.7634], atol=1e-4)
  lo, hi = ruler.wilson(0, 100)
  assert lo == 0.0 and abs(hi - 0.0370) < 1e-4
  lo, hi = ruler.wilson(100, 100)
  assert hi == 1.0 and abs(lo - 0.9630) < 1e-4


def test_seeds_fresh_unless_fixed_and_cells_reproducible():
  assert ruler.fresh_seed() != ruler.fresh_seed()
  a = ruler_tasks.make_example("niah_multikey", ruler.cell_rng(7, "test", "niah_multikey", 1024),
                               1024, BYTES)
  b = ruler_tasks.make_example("niah_multikey", ruler.cell_rng(7, "test", "niah_multikey", 1024),
                               1024, BYTES)
  c = ruler_tasks.make_example("niah_multikey",
                               ruler.cell_rng(7, "validation", "niah_multikey", 1024), 1024,
                               BYTES)
  np.testing.assert_array_equal(a.prompt, b.prompt)
  assert a.answers != c.answers


@pytest.mark.parametrize("args, match", [
    (dict(tasks=("niah_single", "nope")), r"--ruler_tasks: \['nope'\] not among"),
    (dict(lengths=(32,)), r"--ruler_lengths must hold lengths >= 64"),
    (dict(samples=0), r"--ruler_samples and --ruler_batch must be >= 1"),
    (dict(split="train"), r"--ruler_split must be one of \('validation', 'test'\)"),
])
def test_bad_options_name_the_field(args, match):
  kw = dict(tasks=("niah_single",), lengths=(1024,), samples=1, batch=1, split="test")
  with pytest.raises(ValueError, match=match):
    ruler.check_options(**{**kw, **args})


def test_too_short_is_refused_before_any_compute():
  with pytest.raises(ValueError, match=r"ruler task cwe: length 512 is too short .*needs >= \d+"):
    ruler.evaluate_ruler(None, ("niah_single", "cwe"), (512, 4096), samples=1, seed=0)


FAST = EvalOptions(prefill_chunk=128, kv_block=128, ruler_tasks=("niah_single",),
                   ruler_lengths=(320,), ruler_samples=3, ruler_batch=3, ruler_seed=11)


def test_ruler_task_in_memory_writes_json_heatmap_and_report(tmp_path):
  lines = []
  out = tmp_path / "eval"
  r = run_evals(tiny_model(layer_kinds=TWO_LAYERS), ["ruler"], FAST, str(out),
                echo=lines.append)["ruler"]
  assert sorted(os.listdir(out)) == ["results.json", "ruler.json", "ruler_heatmap.png"]
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 5.0}\n')
  page = open(report.write_report(str(tmp_path))).read()      # the run report's section
  assert "RULER-style recall" in page and re.search(r"niah_single\s*</td><td[^>]*>320<", page)
  assert np.array(r["score"]).shape == (1, 1) and r["seed"] == 11 and r["seed_fixed"]
  assert r["corpus"]["split"] == "test" and len(r["corpus"]["sha256"]) == 64
  assert all(0 <= c["wilson_low"] <= c["all_correct"] <= c["wilson_high"] <= 1
             for c in r["cells"])
  assert mpimg.imread(out / "ruler_heatmap.png").ndim == 3
  saved = json.load(open(out / "ruler.json"))
  assert saved["task"] == "ruler" and saved["result"]["cells"][0]["samples"] == 3
  assert any("Wilson" in line for line in lines)


def _cli_values(**kw):
  base = dict(prefill_chunk=128, kv_block=128, ruler_tasks=["niah_single"],
              ruler_lengths=["320"], ruler_samples=2, ruler_batch=2, ruler_seed=3,
              ruler_split="validation")
  return {**base, **kw}


def test_cli_on_a_converted_kimi_linear_checkpoint(tmp_path):
  """The Kimi-Linear path: HF dir -> `convert.from_hf` -> run_eval's main, --task=ruler.
  (vocab 320: the byte tokenizer's ids fit; a real checkpoint brings its own tokenizer.)"""
  hf = write_hf_dir(tmp_path / "hf", tiny_hf_config(vocab_size=320))
  out = str(tmp_path / "export")
  convert.from_hf(hf, out)
  lines = []
  res = main(task="ruler", workdir=None, params=out, output_dir=str(tmp_path / "eval"),
             config=None, option_values=_cli_values(), echo=lines.append)
  r = res["ruler"]
  assert r["split"] == "validation" and r["samples"] == 2
  assert os.path.isfile(tmp_path / "eval" / "ruler_heatmap.png")
  assert any(line.startswith("ruler: what to expect") for line in lines)


def test_cli_rejects_bad_ruler_flags_before_loading(tmp_path):
  with pytest.raises(ValueError, match=r"--ruler_lengths must hold lengths >= 64"):
    main(task="ruler", workdir=None, params=str(tmp_path / "missing"), output_dir=None,
         config=None, option_values=_cli_values(ruler_lengths=["10"]))


@pytest.mark.parametrize("task, needles", [("passkey", 1), ("passkey_multikey", 4)])
def test_passkey_diagnostics_use_the_training_wording_on_heldout_text(task, needles):
  ex = ruler_tasks.make_example(task, np.random.default_rng(6), 4096, BYTES)
  text = _text(BYTES, ex)
  found = re.findall(r"The pass key (?:of the [a-z ]+ )?is (\d{5})\. ", text)
  assert len(found) == needles and ex.answers[0] in found
  if needles > 1:                                  # the asked name's own key
    name = re.search(r"What is the pass key of the ([a-z ]+)\?", text).group(1)
    assert re.search(rf"The pass key of the {name} is {ex.answers[0]}\. ", text)
  assert text.endswith("The pass key is " if needles == 1 else " is ")
  assert text.count(ex.answers[0]) == 1


def test_vocabulary_is_whole_words():
  for split in ("validation", "test"):
    text = " ".join(t for _, t in ruler_text.documents(split)).lower()
    vocab = ruler_text.vocabulary(split)
    assert len(vocab) > 1000
    for w in vocab[::97]:
      assert re.search(rf"\b{w}\b", text), w
