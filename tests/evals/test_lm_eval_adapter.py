"""The lm-evaluation-harness adapter: `lm_eval.simple_evaluate(model="hybridmoe_jax")` on the
local tasks in tests/evals/lm_eval_task (multiple choice, rolling perplexity, generation; no
network) gives, request by request, the numbers of our own scorer (`LoadedModel.score`) and
generator (`LoadedModel.generate`); rolling windows score each token once with as much
context as fits."""

import math
import pathlib

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="the `lm-eval` extra (lm_eval) is not installed")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from hybridmoe_jax import api  # noqa: E402
from hybridmoe_jax.serve import lm_eval_adapter  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.serve.fixtures import write_chat_model  # noqa: E402

TASKS = pathlib.Path(__file__).parent / "lm_eval_task"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
  return write_chat_model(tmp_path_factory.mktemp("lm_eval"))


def _loglik(lm, context, continuation):
  """Our scorer: BOS + context + continuation scored; the continuation's log-prob sum."""
  ctx = lm.tokenizer.encode(context, bos=True).tolist()
  cont = lm.tokenizer.encode(continuation).tolist()
  return float(lm.score(np.asarray(ctx + cont)).logprobs[-len(cont):].astype(np.float64).sum())


def test_simple_evaluate_equals_our_scorer_and_generator(model_path, monkeypatch):
  monkeypatch.chdir(ROOT)                   # the YAMLs' data_files are relative to the root
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  model = lm_eval_adapter.HybridMoELM(workdir=model_path, max_len=512, prefill_chunk=32,
                                      batch_size=4)
  out = lm_eval.simple_evaluate(
      model=model, tasks=["hmoe_choice", "hmoe_rolling", "hmoe_gen"],
      task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
      log_samples=True)
  lm = model.model      # a LoadedModel: its score / generate are the references
  assert isinstance(lm, api.LoadedModel)
  choice = out["samples"]["hmoe_choice"]
  assert len(choice) == 5
  correct = []
  for sample in choice:
    doc = sample["doc"]
    want = [_loglik(lm, doc["question"], " " + c) for c in doc["choices"]]
    got = [r[0] for r in sample["filtered_resps"]]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    correct.append(int(np.argmax(want)) == doc["answer"])
  assert out["results"]["hmoe_choice"]["acc,none"] == pytest.approx(np.mean(correct))
  nll, nbytes = 0.0, 0
  for sample in out["samples"]["hmoe_rolling"]:
    score = lm.score(sample["doc"]["text"])
    assert sample["filtered_resps"][0] == pytest.approx(-score.nll, rel=1e-6)
    nll, nbytes = nll + score.nll, nbytes + score.num_bytes
  assert out["results"]["hmoe_rolling"]["bits_per_byte,none"] == pytest.approx(
      nll / math.log(2) / nbytes, rel=1e-6)
  for sample in out["samples"]["hmoe_gen"]:
    want = lm.generate(sample["doc"]["question"] or [lm.tokenizer.bos_id], max_new_tokens=8,
                       stop=["\n", "."])
    assert sample["resps"][0][0] == want


def test_rolling_windows_and_truncation_at_a_short_context(model_path):
  """max_len 32: a long text is scored in windows (each token once, with the preceding
  tokens that fit), a long context keeps its end, an impossible continuation is refused."""
  cls = get_model("hybridmoe_jax")           # the name `lm_eval --model` looks up
  assert cls is lm_eval_adapter.HybridMoELM
  model = cls.create_from_arg_string(f"workdir={model_path},max_len=32,prefill_chunk=8,"
                                     "batch_size=3")
  lm = model.model
  text = "A text of more than thirty-two bytes, scored in several windows."
  ids = lm.tokenizer.encode(text, bos=True).tolist()         # BOS + 65 bytes
  want = 0.0
  for a in range(0, len(ids) - 1, 31):                        # predict ids[a+1 : a+32]
    b = min(a + 31, len(ids) - 1)
    row = ids[max(0, b + 1 - 32):b + 1]
    want += float(lm.score(np.asarray(row)).logprobs[-(b - a):].astype(np.float64).sum())
  got = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
  assert got[0] == pytest.approx(want, rel=1e-6)
  long_context = "x" * 40
  (ll, greedy), = model.loglikelihood([Instance("loglikelihood", {}, (long_context, " y"), 0)])
  row = lm.tokenizer.encode(long_context, bos=True).tolist()[-30:] + [32, 121]
  assert ll == pytest.approx(
      float(lm.score(np.asarray(row)).logprobs[-2:].astype(np.float64).sum()), rel=1e-6)
  assert isinstance(greedy, bool)
  with pytest.raises(ValueError, match="does not fit max_len=32"):
    model.loglikelihood([Instance("loglikelihood", {}, ("", "z" * 40), 0)])
  with pytest.raises(ValueError, match="unknown"):
    lm_eval_adapter.HybridMoELM(workdir=model_path, pretrained="gpt2")
  with pytest.raises(ValueError, match="max_len='a'"):
    lm_eval_adapter.HybridMoELM(workdir=model_path, max_len="a")
