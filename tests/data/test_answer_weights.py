"""Answer-weighted loss data (issue 31): retrieval documents name their answer spans, and the
tokenizer step, packer and pipelines carry per-token loss weights into batches: the answer
weight on answer tokens, 1 on other real tokens, 0 on padding, also across row splits."""

import pickle

import grain
import numpy as np
import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.run import default_config, run_config_from_dict
from hybridmoe_jax.data import curriculum, documents, packing, pipeline, retrieval, sources, stages
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.train import stage_plan as plan_lib

TOK = ByteTokenizer()


def _weighted(text):
  return documents._tokenize(text, TOK, loss_weights=True)  # pylint: disable=protected-access


@pytest.mark.parametrize("kind", retrieval.KINDS)
def test_documents_name_their_answers(kind):
  src = retrieval.RetrievalSource(600, seed=3, kinds=(kind,), answer_weight=7.0)
  for i in range(5):
    doc = src[i]
    assert isinstance(doc, retrieval.Document) and doc.answer_spans and doc.answer_weight == 7.0
    for a, b in doc.answer_spans:
      if kind == "kv":
        assert doc[a - 7:a].startswith(" k") and doc[a - 1] == "=" and doc[b] == ";"
      elif kind.startswith("text") or kind == "mixkey":   # values of any kind, each stated
        # earlier (the needles); a short one falls back to a passkey, which holds too
        assert doc[b] == "." and all(x in doc[:a] for x in doc[a:b].split(", "))
      else:   # the key right after its question, and it occurs earlier (the needle)
        assert doc[:a].endswith(" is ") and doc[a:b].isdigit() and doc[a:b] in doc[:a]
    back = pickle.loads(pickle.dumps(doc))   # grain workers pickle documents
    assert back == doc and back.answer_spans == doc.answer_spans
    assert back.answer_weight == 7.0


def test_weights_align_with_answer_tokens():
  doc = retrieval.RetrievalSource(400, seed=1, kinds=("passkey",), answer_weight=5.0)[0]
  out = _weighted(doc)
  assert np.array_equal(out["tokens"], TOK.encode(doc, bos=True, eos=True))  # bytes: exact
  (a, b), = doc.answer_spans
  want = np.ones(len(doc) + 2, np.float32)
  want[1 + a:1 + b] = 5.0                       # +1: BOS
  assert np.array_equal(out["loss_weights"], want)
  assert TOK.decode(out["tokens"][out["loss_weights"] == 5.0]) == doc[a:b]
  plain = _weighted("plain text, no span")     # an ordinary document: all 1
  assert np.array_equal(plain["loss_weights"], np.ones(len("plain text, no span") + 2))
  assert _weighted(None) is None


def _pack(elements, seq_len, bins=2):
  ds = grain.MapDataset.source(elements).to_iter_dataset()
  return list(packing.pack_documents(ds, seq_len=seq_len, pad_id=TOK.pad_id, seed=0,
                                     num_packing_bins=bins, loss_weights=True))


def test_packing_carries_weights_across_split_rows_padding_zero():
  docs = [retrieval.RetrievalSource(300, seed=s, kinds=("kv",), answer_weight=9.0)[0]
          for s in range(3)] + ["ordinary text " * 5]
  elems = [_weighted(d) for d in docs]
  rows = _pack(elems, seq_len=128)              # every kv document is split over rows
  # Each token keeps its weight: per (token value, weight) pair, the packed rows hold exactly
  # the pairs of the documents (order-free), and padding cells weigh 0.
  got = [(int(t), float(w)) for r in rows for t, w, s in zip(r["tokens"], r["loss_weights"],
                                                              r["segment_ids"]) if s]
  want = [(int(t), float(w)) for e in elems for t, w in zip(e["tokens"], e["loss_weights"])]
  assert sorted(got) == sorted(want)
  for r in rows:
    assert r["loss_weights"].dtype == np.float32 and r["loss_weights"].shape == (128,)
    assert np.all(r["loss_weights"][r["segment_ids"] == 0] == 0)
    assert np.all(r["loss_weights"][r["segment_ids"] > 0] >= 1)
  # Pieces in order reassemble each document's weights exactly (one bin: rows in order).
  rows = _pack(elems[:1], seq_len=100, bins=1)
  w = np.concatenate([r["loss_weights"][r["segment_ids"] > 0] for r in rows])
  assert np.array_equal(w, elems[0]["loss_weights"])
  toks = np.concatenate([r["tokens"][r["segment_ids"] > 0] for r in rows])
  assert TOK.decode(toks[w == 9.0]) == "".join(docs[0].answers())


def test_pipelines_carry_weights():
  src = retrieval.RetrievalSource(200, seed=0, num_documents=64, answer_weight=4.0)
  it = pipeline.make_pipeline([src, ["some text here."] * 8], tokenizer=TOK, seq_len=256,
                              batch_size=2, seed=0, weights=[1.0, 1.0], loss_weights=True)
  b = next(it)
  assert b["loss_weights"].shape == (2, 256) and b["loss_weights"].dtype == np.float32
  assert set(np.unique(b["loss_weights"])) <= {0.0, 1.0, 4.0} and (b["loss_weights"] == 4).any()
  assert np.array_equal(b["loss_weights"] == 0, b["segment_ids"] == 0)
  assert "loss_weights" not in next(pipeline.make_pipeline(src, tokenizer=TOK, seq_len=256,
                                                           batch_size=2, seed=0))
  stage = stages.StageData(index=0, seq_len=256, batch_size=2, steps=1, components=(
      stages.Component("retrieval", src, 1.0),), loss_weights=True)
  b = next(iter(stages.make_stage_dataset(stage, tokenizer=TOK, prefetch_batches=0)))
  assert (b["loss_weights"] == 4).any() and np.array_equal(b["loss_weights"] == 0,
                                                           b["segment_ids"] == 0)


def _curriculum(**stage):
  config = default_config()
  c = config.curriculum
  c.tokens_per_step = 1024
  c.sources = {"pydoc": {"kind": "bundled"}}
  c.stages = (dict(dict(seq_len=256, steps=2, weights={"pydoc": 1.0}, retrieval_fraction=0.5),
                   **stage),)
  config.train.steps = 2
  return config


def test_stage_field_reaches_the_plan_and_its_range_names_the_field():
  plan = plan_lib.build_plan(run_config_from_dict(_curriculum(
      retrieval_answer_weight=8.0, retrieval_kinds=("passkey",), retrieval_bytes=(64, 128))))
  (s,) = plan.stages
  assert s.retrieval_answer_weight == 8.0 and s.retrieval_kinds == ("passkey",)
  assert s.retrieval_bytes == (64, 128)
  for bad, match in [(dict(retrieval_answer_weight=0.5), r"stages\[0\].retrieval_answer_weight"),
                     (dict(retrieval_answer_weight=500.0), r"retrieval_answer_weight"),
                     (dict(retrieval_kinds=("poem",)), r"stages\[0\].retrieval_kinds"),
                     (dict(retrieval_kinds=()), r"stages\[0\].retrieval_kinds"),
                     (dict(retrieval_fraction=0.95), r"stages\[0\].retrieval_fraction"),
                     (dict(retrieval_bytes=(32, 128)), r"stages\[0\].retrieval_bytes"),
                     (dict(retrieval_bytes=(200, 100)), r"stages\[0\].retrieval_bytes"),
                     (dict(retrieval_bytes=(64, 300)), r"seq_len - 2 = 254")]:
    with pytest.raises(ConfigError, match=match):
      run_config_from_dict(_curriculum(**bad))


def test_retrieval_bytes_bound_the_documents_of_a_stage():
  """The stage's (shortest, longest) reach the retrieval source: every document's length lies
  in the range, and a stage of short documents packs several answers into a row."""
  data = curriculum.stage_data(plan_lib.build_plan(run_config_from_dict(_curriculum(
      retrieval_bytes=(64, 100), retrieval_fraction=0.8))).stages,
      {"pydoc": sources.BundledTextSource()}, seed=0)
  (src,) = [c.source for c in data[0].components if c.name == "retrieval"]
  assert src.lengths.min() >= 64 and src.lengths.max() <= 100
  assert all(64 - 8 <= len(src[i]) <= 100 + 8 for i in range(20))
