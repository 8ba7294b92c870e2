"""Retrieval documents (data/retrieval.py) and the held-out NIAH / key-value prompts built from
the same pieces: each answer occurs once before its question, at the requested depth; the text
survives the tokenizers; train and eval keys and seed streams are disjoint."""

import pathlib
import re

import numpy as np
import pytest

from hybridmoe_jax.data import retrieval
from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.data.tokenizers.load import make_tokenizer
from benchmarks.long_context_retrieval import kv_recall_example
from hybridmoe_jax.evals import niah

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_key_spaces_are_disjoint_and_cover_all_keys():
  keys = [f"{i:05d}" for i in range(100_000)]
  evals = {k for k in keys if retrieval.key_split(k) == "eval"}
  assert 0.2 < len(evals) / len(keys) < 0.3                 # about a quarter held out
  rng = np.random.default_rng(0)
  train = {retrieval.draw_key(rng, "train") for _ in range(3000)}
  held = {retrieval.draw_key(rng, "eval") for _ in range(3000)}
  assert not train & evals and held <= evals
  # Every key inside every training document is a train key; every NIAH answer an eval key.
  src = retrieval.RetrievalSource(2000, seed=5)
  for i in range(30):
    for k in re.findall(r"pass key (?:of the [a-z ]+ )?is (\d{5})", src[i]):
      assert retrieval.key_split(k) == "train"
    for k in re.findall(r"(k[0-9a-f]{4})=", src[i]):
      assert retrieval.key_split(k) == "train"
  for seed in range(20):
    ex = niah.make_example(retrieval.rng_for("eval", seed, 0), 300, 0.5)
    assert retrieval.key_split(ex.answer) == "eval"
  with pytest.raises(ValueError, match="split"):
    retrieval.RetrievalSource(400, split="test")
  with pytest.raises(ValueError, match="target_bytes"):
    retrieval.RetrievalSource(10)
  with pytest.raises(ValueError, match="kinds"):
    retrieval.RetrievalSource(400, kinds=("passkey", "poem"))


def test_train_and_eval_seed_streams_differ():
  a = retrieval.RetrievalSource(500, seed=0)[3]
  b = retrieval.RetrievalSource(500, seed=0, split="eval")[3]
  assert a == retrieval.RetrievalSource(500, seed=0)[3] and a != b
  assert a != retrieval.RetrievalSource(500, seed=1)[3]


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_passkey_document_answer_once_at_depth(depth):
  """A training passkey document: the key once in the needle, once as the answer; no other
  digits; the needle where asked (the generator's depth is uniform: check by fixing it)."""
  for i in range(20):
    doc = retrieval.RetrievalSource(1000, seed=i, kinds=("passkey",))[0]
    assert len(doc) == 1000
    key = doc.rsplit(retrieval.QUESTION, 1)[1].rstrip(".")
    assert len(key) == 5 and doc.count(key) == 2 and sum(c.isdigit() for c in doc) == 10
    assert doc.index(retrieval.needle_text(key)) < doc.index(retrieval.QUESTION)
  text, cuts = retrieval.hay(np.random.default_rng(0), 900)
  assert len(text) == 900 and cuts[0] == 0 and cuts[-1] == 900 and not re.search(r"\d", text)
  out = retrieval._insert(text, cuts, np.array([depth]), ["NEEDLE "])  # pylint: disable=protected-access
  assert abs(out.index("NEEDLE") - depth * 900) <= 25          # nearest sentence boundary


def test_multikey_and_kv_documents():
  src = retrieval.RetrievalSource(1500, seed=2)
  for i in range(1, 30, 3):                                       # multikey documents
    doc = src[i]
    needles = dict(re.findall(r"The pass key of the ([a-z ]+?) is (\d{5})\. ", doc))
    asked = re.findall(r"What is the pass key of the ([a-z ]+?)\? The pass key of the \1 is "
                       r"(\d{5})\. ", doc)
    assert 2 <= len(needles) <= 4 and 1 <= len(asked) <= len(needles)
    for name, key in asked:
      assert needles[name] == key and doc.count(key) == 2       # the needle and the answer
  for i in range(2, 30, 3):                                       # kv documents
    doc = src[i]
    pairs, recall = doc.split(" Recall:")
    want = dict(p.strip().split("=") for p in recall.split(";") if p.strip())
    assert len(want) >= 2 and all(pairs.count(f" {k}={v};") == 1 for k, v in want.items())


def test_niah_prompt_is_the_training_format():
  """The NIAH prompt (BOS + hay + needle + hay + question) is a prefix of a passkey document
  in form: the same needle and question strings, the hay from the same sentence generator."""
  tok = ByteTokenizer()
  ex = niah.make_example(np.random.default_rng(1), 700, 0.3)
  text = tok.decode(ex.prompt)
  assert text.endswith(retrieval.QUESTION) and text.count(ex.answer) == 1
  assert text.index(retrieval.needle_text(ex.answer)) == ex.needle_start - 1
  sentences = set(re.findall(r"[A-Z][a-z ]+\. ", text.replace(retrieval.needle_text(ex.answer),
                                                              "")))
  gen = retrieval.hay_sentences(np.random.default_rng(0))
  vocabulary = {next(gen) for _ in range(5000)}
  assert sentences - {"Remember it. "} <= vocabulary | {s[4:] for s in vocabulary}


@pytest.mark.parametrize("tokenizer", ["bytes", "bundled_bpe1024"])
def test_tokenizer_round_trip(tokenizer):
  tok = ByteTokenizer() if tokenizer == "bytes" else make_tokenizer(str(ROOT / "configs" / "tokenizers" / tokenizer))
  src = retrieval.RetrievalSource(600, seed=9)
  for i in range(6):
    ids = tok.encode(src[i], bos=True, eos=True)
    assert tok.decode(ids[1:-1]) == src[i]
  ex = niah.make_example(np.random.default_rng(2), 400, 0.5, tokenizer=tok)
  assert len(ex.prompt) == 400 and ex.answer in tok.decode(ex.prompt[1:])
  digits = tok.encode(ex.answer)
  assert tok.decode(digits) == ex.answer
  toks, mask = kv_recall_example(np.random.default_rng(3), 600, 8, tok)
  values = [tok.decode(toks[s:e]) for s, e in _runs(mask)]
  assert len(values) == 8 and all(re.fullmatch(r"\d\d", v) for v in values)
  assert tok.decode(toks[1:]).count(" Recall:") == 1


def _runs(mask):
  d = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
  return zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1))


@pytest.mark.parametrize("target", [128, 200, 510, 3000])
def test_variable_lengths_fit_their_rows(target):
  """Lengths drawn in [min_bytes, target] are the documents' lengths (a multi-key document
  holds only as many needles and questions as fit; below two it is a passkey document)."""
  src = retrieval.RetrievalSource(target, min_bytes=128, seed=4)
  assert src.lengths.min() >= 128 and src.lengths.max() <= target
  for i in range(45):
    assert len(src[i]) == src.lengths[i]
  if target == 3000:
    assert len(set(src.lengths[:100])) > 50
  with pytest.raises(ValueError, match="min_bytes"):
    retrieval.RetrievalSource(target, min_bytes=target + 1)


def test_retrieval_weight_gives_the_token_share():
  """The mix draws documents; the retrieval weight makes their token share the fraction."""
  from hybridmoe_jax.data import curriculum, stages  # pylint: disable=g-import-not-at-top

  class Docs:
    def __init__(self, lengths):
      self.lengths = np.asarray(lengths)

    def __len__(self):
      return len(self.lengths)

  comps = [stages.Component("a", Docs([6000, 2000]), 1.0),
           stages.Component("b", Docs([300] * 4), 3.0)]
  src = retrieval.RetrievalSource(510, min_bytes=128)
  for f in (0.1, 0.5):
    w = curriculum.retrieval_weight(f, comps, src)
    text = 1.0 * 4000 + 3.0 * 300
    share = w * src.lengths.mean() / (w * src.lengths.mean() + text)
    assert share == pytest.approx(f)
  # Upsampled long documents count as often as they are drawn.
  w_up = curriculum.retrieval_weight(0.5, comps[:1], src, long_upsample=3, long_min_bytes=5000)
  assert w_up * src.lengths.mean() == pytest.approx((3 * 6000 + 2000) / 4)


def test_stage_niah_lengths_capped_per_stage(tmp_path):
  """curriculum.niah_max_factor: after a stage of T tokens only prompts up to factor x T (at
  least the shortest); 0 keeps every length."""
  from hybridmoe_jax.evals.stage_niah import StageNiah  # pylint: disable=g-import-not-at-top
  lengths = (512, 1024, 4096, 65536)
  capped = StageNiah(str(tmp_path), lengths, (0.5,), samples=1, tokenizer=ByteTokenizer(),
                     max_factor=8)
  assert capped.lengths_after(512) == (512, 1024, 4096)
  assert capped.lengths_after(8192) == lengths and capped.lengths_after(16) == (512,)
  assert StageNiah(str(tmp_path), lengths, (0.5,), samples=1,
                   tokenizer=ByteTokenizer()).lengths_after(16) == lengths


def _fact_patterns():
  """(fact regex, question regex) per phrasing, from the module's own templates."""
  out = []
  for fact, question in retrieval._FACTS:  # pylint: disable=protected-access
    f = re.escape(fact).replace(r"\{label\}", "(?P<label>[a-z ]+?)").replace(
        r"\{name\}", "(?P<name>[0-9a-z ]+?)").replace(r"\{value\}", "(?P<value>[0-9a-z]+)")
    q = re.escape(question).replace(r"\{label\}", "[a-z ]+?").replace(
        r"\{name\}", "(?P<name>[0-9a-z ]+?)", 1).replace(r"\{name\}", "(?P=name)")
    out.append((f, q))
  return out


def test_textkey_answers_follow_from_the_facts_in_real_text():
  """Slow reference: parse each document's facts and questions back out of its text and
  recompute every answer span; the hay is pydoc text with its own digits."""
  src = retrieval.RetrievalSource(3000, min_bytes=600, seed=4, kinds=("textkey",))
  with_digits = 0
  for i in range(40):
    doc = src[i]
    first = doc.answer_spans[0][0]
    for fact, question in _fact_patterns():
      facts = [m.groupdict() for m in re.finditer(fact, doc[:first])]
      if len(facts) >= 2:
        break
    assert len({f["name"].strip() for f in facts}) >= 2   # distractors of the same shape
    prev = 0
    for (a, b), ans in zip(doc.answer_spans, doc.answers()):
      asked = doc[prev:a]
      m = re.search(question + "$", asked) or re.search(r"List every [a-z ]+ of (?P<name>"
                                                        r"[0-9a-z ]+?): $", asked)
      assert m, asked[-120:]
      want = [f["value"] for f in facts if f["name"].strip() == m.group("name")]
      assert ans == ", ".join(want) and want
      prev = b
    body = doc[:first]
    for f in facts:
      body = body.replace(f["value"], "")
    with_digits += bool(re.search(r"\d", body))
  assert with_digits >= 10                               # numbers besides the values


def test_textchain_answers_follow_the_assignments():
  src = retrieval.RetrievalSource(2000, min_bytes=400, seed=5, kinds=("textchain",))
  for i in range(20):
    doc = src[i]
    value = re.search(r"Which names hold (\d+)\? $", doc[:doc.answer_spans[0][0]]).group(1)
    chain = re.findall(rf"Let (m_[a-z]{{2}}) be {value}\. ", doc)
    links = dict((b, a) for b, a in re.findall(r"Set (m_[a-z]{2}) to (m_[a-z]{2})\. ", doc))
    while True:
      nxt = [b for b, a in links.items() if a == chain[-1]]
      if not nxt:
        break
      chain += nxt
    assert doc.answers() == [", ".join(chain)] and len(chain) >= 2


def _mixkey_facts(body: str):
  """(key, value) of every "<adj> <noun> <tie> <key> <verb> <value>. " in `body`, parsed with
  the wording lists (the reference for the generator's answers)."""
  from hybridmoe_jax.data import retrieval_wording as w  # pylint: disable=g-import-not-at-top
  alt = lambda xs: "|".join(re.escape(x) for x in sorted(set(xs) - {""}, key=len, reverse=True))
  verbs = "|".join([r" (?:%s)" % alt(v for v in w.VERBS if v not in (":", "=")), ":", "="])
  fact = re.compile(rf"(?:{alt(w.NOUNS)}) (?:{alt(w.TIES)}) (?P<key>[\w -]+?)(?:{verbs}) "
                    r"(?P<value>[\w-]+)\. ")
  asked = re.compile(rf"(?:{alt(w.NOUNS)})s? (?:{alt(w.TIES)}) ")   # then the asked key
  found = list(fact.finditer(body))
  return [(m["key"], m["value"]) for m in found], (found[-1].end() if found else 0), asked


def test_mixkey_answers_follow_from_the_facts():
  """Slow reference: every answer is recomputed from the facts parsed back out of the text
  (the values whose key the question names); most documents have distractor facts."""
  src = retrieval.RetrievalSource(2500, min_bytes=300, seed=6, kinds=("mixkey",))
  with_distractors = wordings = 0
  seen = set()
  for i in range(60):
    doc = src[i]
    if doc.startswith(retrieval.QUESTION) or retrieval.QUESTION in doc:   # short: a passkey
      continue
    facts, prev, ask = _mixkey_facts(doc[:doc.answer_spans[0][0]])   # questions after facts
    keys = {k for k, _ in facts}
    with_distractors += len(keys) >= 2
    for (a, b), ans in zip(doc.answer_spans, doc.answers()):
      asked = doc[prev:a]
      at = [m.end() for m in ask.finditer(asked)][-1]     # the question's "<noun> <tie> "
      named = [k for k in keys if re.match(rf"{re.escape(k)}(?![\w-])", asked[at:])]
      assert len(named) == 1, (asked, keys)
      assert ans == ", ".join(v for k, v in facts if k == named[0]), (asked, facts)
      prev = b
    seen.add(re.sub(r"[\w-]+(?=\. )", "", doc[doc.answer_spans[0][0] - 60:
                                                doc.answer_spans[0][0]]))
    wordings += 1
  assert wordings >= 40 and with_distractors >= wordings // 2
  assert len(seen) >= 0.9 * wordings                       # a new wording nearly every time


def test_no_training_document_holds_the_evaluation_wording():
  """The RULER-style suite's NIAH strings (and RULER's own) are excluded by construction:
  no fragment of 12+ characters of its templates is in any training document of any kind."""
  from hybridmoe_jax.data import retrieval_wording as w  # pylint: disable=g-import-not-at-top
  from hybridmoe_jax.evals import ruler_tasks  # pylint: disable=g-import-not-at-top
  banned = {"special magic", "magic number", "in the text above", "quiz you about"}
  for template in ruler_tasks.NIAH_TEMPLATES.values():
    for v in ruler_tasks._KIND_NAMES.values():   # pylint: disable=protected-access
      for part in re.split(r"\{[kx]\}", template.replace("{v}", v)):
        if len(part.strip()) >= 12:
          banned.add(part)
  assert any("special number for" in b for b in banned) and len(banned) >= 12
  words = " ".join(w.ADJECTIVES + w.NOUNS + w.OPENINGS + w.PLACES + w.QUESTIONS).lower()
  assert "special" not in words and "magic" not in words
  for length, least in ((256, 64), (2046, 64), (8190, 2000)):
    src = retrieval.RetrievalSource(length, min_bytes=least, seed=7, kinds=retrieval.KINDS)
    for i in range(48 if length < 8000 else 12):
      doc = src[i]
      hits = [b for b in banned if b.lower() in doc.lower()]
      assert not hits, (src.kinds[i % len(src.kinds)], hits)
