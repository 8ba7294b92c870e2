"""Synthetic long-range retrieval documents (passkey, multi-key NIAH, key-value recall).

Mixed into the curriculum's text as one more source (`curriculum.stages[k].retrieval_fraction`),
they give the model examples where the answer sits far before the question, which natural
text rarely forces. Every document is plain text the packer handles like any other:

  passkey:   hay ... "The pass key is 48213. Remember it. " ... hay
             "What is the pass key? The pass key is 48213."
  multikey:  2-4 needles "The pass key of the red door is 48213. " (the others are
             distractors) at random depths, then 1-4 of them asked in a shuffled order:
             "What is the pass key of the red door? The pass key of the red door is 48213. "
  kv:        " k3f9a=71;" pairs spread through the hay, then " Recall: k0b2c=05; k3f9a=71; ..."
             (MQAR in text: every pair queried once, shuffled)

The hay is short sentences drawn from small word lists (no digits), so a key's digits occur
only in its needle and its answer. Two kinds read real text instead (`text_hay`: consecutive
sentences of the pydoc help texts, numbers and all), so a model cannot key on "the only digits
in the prompt" and must pick the asked value among others of the same shape:

  textkey:   2-6 facts in one of several phrasings, names and values of a random kind (word
             pairs, hex ids, numbers; values of 3-8 digits, a word or hex), one name
             sometimes holding 2-3 values ("List every tag of ...: a, b, c"); then 1-3 asked
  textchain: "Let m_ab be 4821." ... "Set m_cd to m_ab." chains (one asked, one distracting),
             then "Which names hold 4821? m_ab, m_cd, ..."
  mixkey:    key -> value facts in a wording composed per document from independent parts
             (`retrieval_wording`: nouns, adjectives, ties, verbs, openings, headers,
             questions, answer prefixes), distractors of the same shape, 1-2 asked

These phrasings are not the RULER-style suite's (`evals.ruler_tasks`), and its haystack is
other text (CPython's IDLE docs, which training never reads): the evaluation measures retrieval
that generalises, not a memorised template. The evaluation (`evals.niah`,
`benchmarks/long_context_retrieval.py`'s kv recall) builds its prompts from the same pieces,
with held-out content: keys come from a disjoint key space (`key_split`: a fixed hash puts
every key in "train" or "eval"), and hay, depths and keys from a disjoint seed stream
(`rng_for`). Nothing the evaluation asks was trained on.

Document i is a pure function of (split, seed, i): the source has a fixed (virtual) length
and needs no storage, so it is indexed, sharded and checkpointed like any other source.

Every document is a `Document`: a str that also names its answer spans (the characters a model
must retrieve: the key after a question, the values of the recall part) and the loss weight of
those characters' tokens (`RetrievalSource(answer_weight=...)`). The tokenizer step turns the
spans into per-token loss weights when the pipeline asks for them (`documents.tokenize_documents`),
so the copy a retrieval document teaches is not drowned by its hay in the loss.
"""

from __future__ import annotations

import functools
import re
import zlib
from collections.abc import Iterator

import numpy as np

from hybridmoe_jax.data import retrieval_wording

KINDS = ("passkey", "multikey", "kv", "textkey", "textchain", "mixkey")
DEFAULT_KINDS = ("passkey", "multikey", "kv")   # without retrieval_kinds (as before textkey)
SPLITS = ("train", "eval")
QUESTION = "What is the pass key? The pass key is "

_SUBJECTS = ("grass", "sky", "sun", "river", "old house", "small bird", "garden", "mountain",
             "city", "forest", "lake", "road", "tree", "cloud", "field", "bridge")
_STATES = ("green", "blue", "yellow", "quiet", "far away", "very old", "warm", "cold",
           "bright", "wide", "calm", "busy", "dark", "soft", "tall", "empty")
_TEMPLATES = ("The {s} is {a}. ", "Here the {s} looks {a}. ", "We saw that the {s} was {a}. ",
              "The {s} will be {a} again. ")
_NAME_COLORS = ("red", "blue", "green", "gray", "white", "black", "brown", "pink")
_NAME_THINGS = ("door", "box", "car", "boat", "lamp", "chair", "key ring", "garden gate")
NAMES = tuple(f"{c} {t}" for c in _NAME_COLORS for t in _NAME_THINGS)


def needle_text(key: str) -> str:
  """The passkey needle (the key occurs once in a document besides its answer)."""
  return f"The pass key is {key}. Remember it. "


def named_needle(name: str, key: str) -> str:
  return f"The pass key of the {name} is {key}. "


def named_question(name: str) -> str:
  """The question of a multi-key document; the key and ". " follow."""
  return f"What is the pass key of the {name}? The pass key of the {name} is "


class Document(str):
  """A retrieval document: the text, plus `answer_spans` ((start, end) character ranges of the
  answer, in order, non-overlapping) and `answer_weight` (the loss weight of their tokens; 1.0:
  none extra). Being a str, it goes wherever a document goes; pickles with its fields."""

  answer_spans: tuple[tuple[int, int], ...] = ()
  answer_weight: float = 1.0

  @classmethod
  def make(cls, text: str, spans, weight: float = 1.0) -> "Document":
    doc = cls(text)
    doc.answer_spans = tuple((int(a), int(b)) for a, b in spans)
    doc.answer_weight = float(weight)
    return doc

  def answers(self) -> list[str]:
    """The answer texts, in order."""
    return [self[a:b] for a, b in self.answer_spans]


def _from_pieces(pieces: list[tuple[str, bool]]) -> Document:
  """[(text, is_answer)] -> their concatenation, the is_answer pieces as its answer spans."""
  spans, n = [], 0
  for t, is_answer in pieces:
    if is_answer:
      spans.append((n, n + len(t)))
    n += len(t)
  return Document.make("".join(t for t, _ in pieces), spans)


# --------------------------------------------------------------------------- held-out split
def key_split(key: str) -> str:
  """"eval" for about a quarter of all keys (crc32 % 4 == 0), else "train": a fixed hash, so
  the two key spaces are disjoint and neither follows a digit pattern a model could learn."""
  return "eval" if zlib.crc32(key.encode()) % 4 == 0 else "train"


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"retrieval split must be one of {SPLITS}, got {split!r}")


def rng_for(split: str, seed: int, index: int) -> np.random.Generator:
  """The generator of document `index`: train and eval documents draw from disjoint seed
  streams (the split is part of the seed), so no evaluation hay or depth is ever trained on."""
  _check_split(split)
  return np.random.default_rng([SPLITS.index(split), seed, index])


def draw_key(rng: np.random.Generator, split: str, num_digits: int = 5) -> str:
  """A random `num_digits`-digit key from `split`'s key space (rejection sampling)."""
  _check_split(split)
  if num_digits < 1:  # both key spaces are non-empty from 1 digit on (2 of 10 keys are eval)
    raise ValueError(f"keys need num_digits >= 1, got {num_digits}")
  while True:
    key = "".join(str(d) for d in rng.integers(0, 10, num_digits))
    if key_split(key) == split:
      return key


def distinct(draw, n: int, avoid=()) -> list:
  """The first n distinct results of draw() that are not in `avoid`, in the order drawn
  (they must be hashable)."""
  out, seen = [], set(avoid)
  while len(out) < n:
    x = draw()
    if x not in seen:
      seen.add(x)
      out.append(x)
  return out


# --------------------------------------------------------------------------- hay
def hay_sentences(rng: np.random.Generator) -> Iterator[str]:
  """Endless filler sentences, each ending in ". " (no digits)."""
  while True:
    t, s, a = rng.integers(len(_TEMPLATES)), rng.integers(len(_SUBJECTS)), rng.integers(
        len(_STATES))
    yield _TEMPLATES[t].format(s=_SUBJECTS[s], a=_STATES[a])


def hay(rng: np.random.Generator, n_bytes: int) -> tuple[str, list[int]]:
  """(exactly n_bytes of filler, its sentence boundaries incl. 0 and n_bytes); the last
  sentence is cut to fit."""
  parts, cuts, n = [], [0], 0
  it = hay_sentences(rng)
  while n < n_bytes:
    s = next(it)[:n_bytes - n]
    parts.append(s)
    n += len(s)
    cuts.append(n)
  return "".join(parts), cuts


def _insert(text: str, cuts: list[int], depths: np.ndarray, pieces: list[str]) -> str:
  """`pieces` inserted into `text` at the sentence boundaries nearest depth * len(text)."""
  at = [int(min(cuts, key=lambda c, d=d: abs(c - d * len(text)))) for d in depths]
  order = np.argsort(at, kind="stable")
  out, prev = [], 0
  for j in order:
    out += [text[prev:at[j]], pieces[j]]
    prev = at[j]
  return "".join(out) + text[prev:]


# --------------------------------------------------------------------------- documents
def passkey_document(rng: np.random.Generator, target_bytes: int, split: str = "train",
                     num_digits: int = 5) -> Document:
  """A passkey at a uniform random depth inside ~target_bytes of hay, asked for at the end
  (the answer span: the key after the question)."""
  key = draw_key(rng, split, num_digits)
  needle, question = needle_text(key), QUESTION + key + "."
  text, cuts = hay(rng, max(target_bytes - len(needle) - len(question), 0))
  body = _insert(text, cuts, rng.uniform(0, 1, 1), [needle])
  return _from_pieces([(body + QUESTION, False), (key, True), (".", False)])


def multikey_document(rng: np.random.Generator, target_bytes: int, split: str = "train",
                      num_digits: int = 5) -> Document:
  """2-4 named needles (each a distractor for the others) at random depths, then 1-4 of
  them asked for (shuffled); as many as fit in target_bytes (a passkey document when not even
  two needles and a question do)."""
  needle_bytes, question_bytes = 50 + num_digits, 100 + num_digits   # longest name
  most = min(4, (target_bytes - question_bytes) // needle_bytes)
  if most < 2:
    return passkey_document(rng, target_bytes, split, num_digits)
  n = int(rng.integers(2, most + 1))
  names = [NAMES[j] for j in rng.choice(len(NAMES), n, replace=False)]
  keys = distinct(lambda: draw_key(rng, split, num_digits), n)
  fit = min(n, (target_bytes - n * needle_bytes) // question_bytes)
  asked = rng.permutation(n)[:int(rng.integers(1, fit + 1))]
  questions = [p for j in asked for p in ((named_question(names[j]), False), (keys[j], True),
                                           (". ", False))]
  needles = [named_needle(nm, k) for nm, k in zip(names, keys)]
  room = max(target_bytes - sum(map(len, needles)) - sum(len(t) for t, _ in questions), 0)
  text, cuts = hay(rng, room)
  return _from_pieces([(_insert(text, cuts, rng.uniform(0, 1, n), needles), False)] + questions)


def kv_pairs(rng: np.random.Generator, split: str, n: int) -> tuple[list[str], list[str]]:
  """n distinct keys "k3f9a" from `split`'s key space and their 2-digit values."""
  keys: list[str] = []
  while len(keys) < n:
    k = f"k{int(rng.integers(1 << 16)):04x}"
    if key_split(k) == split and k not in keys:
      keys.append(k)
  return keys, [f"{v:02d}" for v in rng.integers(0, 100, n)]


def kv_pieces(rng: np.random.Generator, target_bytes: int, split: str = "train",
              num_pairs: int | None = None) -> list[tuple[str, bool]]:
  """A key-value document as [(text, is_answer)]: the answers are the values in the recall
  part (what a model must retrieve); joined, the texts are `kv_document`."""
  n = num_pairs or int(min(64, max(2, target_bytes // 64)))
  keys, vals = kv_pairs(rng, split, n)
  pairs = [f" {k}={v};" for k, v in zip(keys, vals)]
  room = max(target_bytes - 2 * sum(map(len, pairs)) - len(" Recall:"), 0)
  text, cuts = hay(rng, room)
  out = [(_insert(text, cuts, rng.uniform(0, 1, n), pairs) + " Recall:", False)]
  for j in rng.permutation(n):
    out += [(f" {keys[j]}=", False), (vals[j], True), (";", False)]
  return out


def kv_document(rng: np.random.Generator, target_bytes: int, split: str = "train",
                num_pairs: int | None = None) -> Document:
  """Key-value pairs spread through ~target_bytes of hay, then all of them queried (the
  answer spans: the recalled values)."""
  return _from_pieces(kv_pieces(rng, target_bytes, split, num_pairs))


# --------------------------------------------------------------------------- real-text hay
# Phrasings of a fact and its question ({label} {name} {value}); several, so no single
# template is what the model learns. None is the evaluation suite's.
_FACTS = (("The {label} of {name} is {value}. ", "What is the {label} of {name}? The {label} "
           "of {name} is "),
          ("Note that {name} has {label} {value}. ", "Which {label} does {name} have? "
           "{name} has {label} "),
          ("For {name}, use {label} {value}. ", "For {name}, which {label} should be used? "
           "Use {label} "),
          ("{name}: {label} = {value}. ", "Recall the {label} of {name}: "))
_LABELS = ("pass key", "access code", "serial number", "tag", "ticket", "pin", "token",
           "record id")
_CHAIN_NAMES = np.array(list("abcdefghijklmnopqrstuvwxyz"))


@functools.lru_cache(maxsize=1)
def _pydoc_text() -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(sentences of the pydoc help texts, their distinct 4-10 letter words), whitespace
  normalised: the training corpus's own text (`sources.BundledTextSource`)."""
  from hybridmoe_jax.data import sources  # pylint: disable=g-import-not-at-top
  docs = sources.BundledTextSource()
  sents, words = [], set()
  for i in range(len(docs)):
    flat = " ".join(docs[i].split())
    sents += [x + " " for x in re.split(r"(?<=[.!?]) +", flat) if 8 <= len(x) <= 400]
    words.update(re.findall(r"\b[a-z]{4,10}\b", flat))
  return tuple(sents), tuple(sorted(words))


def text_hay(rng: np.random.Generator, n_bytes: int) -> tuple[str, list[int]]:
  """(exactly n_bytes of consecutive pydoc sentences from a random start, its sentence
  boundaries incl. 0 and n_bytes): real text, digits included."""
  sents = _pydoc_text()[0]
  i, parts, cuts, n = int(rng.integers(len(sents))), [], [0], 0
  while n < n_bytes:
    x = sents[i % len(sents)][:n_bytes - n]
    parts.append(x)
    n += len(x)
    cuts.append(n)
    i += 1
  return "".join(parts), cuts


def _text_token(rng: np.random.Generator, kind: str) -> str:
  """A name or value: "words" two pydoc words, "hyphen" the same joined by "-", "word" one,
  "hex" 8 hex digits, "uuid" 8-4-4-4-12 hex, a number "N" N digits."""
  words = _pydoc_text()[1]
  if kind in ("words", "hyphen"):
    a, b = rng.choice(len(words), 2, replace=False)
    return f"{words[a]}{' ' if kind == 'words' else '-'}{words[b]}"
  if kind == "word":
    return words[int(rng.integers(len(words)))]
  if kind in ("hex", "uuid"):
    h = "".join(rng.choice(list("0123456789abcdef"), 8 if kind == "hex" else 32))
    return h if kind == "hex" else f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
  return str(int(rng.integers(10 ** (int(kind) - 1), 10 ** int(kind))))   # digits


def textkey_document(rng: np.random.Generator, target_bytes: int, split: str = "train"
                     ) -> Document:
  """2-6 facts of one phrasing (names and values of one random kind each, one name possibly
  holding 2-3 values) in ~target_bytes of pydoc text, then 1-3 questions (answer spans)."""
  fact, question = _FACTS[int(rng.integers(len(_FACTS)))]
  label = _LABELS[int(rng.integers(len(_LABELS)))]
  name_kind = ("words", "hex", "4")[int(rng.integers(3))]
  value_kind = ("3", "5", "7", "8", "word", "hex")[int(rng.integers(6))]
  n = int(rng.integers(2, 7))
  names = distinct(lambda: _text_token(rng, name_kind), n)
  multi = int(rng.integers(2, 4)) if rng.uniform() < 0.25 else 1   # values of names[0]
  values = distinct(lambda: _text_token(rng, value_kind), n - 1 + multi)
  owners = [names[0]] * multi + names[1:]
  facts = [fact.format(label=label, name=o, value=v) for o, v in zip(owners, values)]
  asked = [0] + list(rng.permutation(np.arange(1, n))[:int(rng.integers(0, 3))])
  pieces = []
  for j in rng.permutation(asked):
    if j == 0 and multi > 1:
      pieces += [(f"List every {label} of {names[0]}: ", False),
                 (", ".join(values[:multi]), True), (". ", False)]
    else:
      pieces += [(question.format(label=label, name=names[j]), False),
                 (values[multi - 1 + j], True), (". ", False)]
  room = target_bytes - sum(map(len, facts)) - sum(len(t) for t, _ in pieces)
  if room < 0:     # a short document: the facts do not fit, a plain passkey does
    return passkey_document(rng, target_bytes, split)
  text, cuts = text_hay(rng, room)
  depths = rng.uniform(0, 1, len(facts))
  depths[:multi] = np.sort(depths[:multi])   # names[0]'s values in the order they are listed
  body = _insert(text, cuts, depths, facts)
  return _from_pieces([(body, False)] + pieces)


def textchain_document(rng: np.random.Generator, target_bytes: int, split: str = "train"
                       ) -> Document:
  """Two assignment chains of 2-4 links ("Let m_ab be 4821." then "Set m_cd to m_ab.") in
  ~target_bytes of pydoc text, in order; the first chain's names asked for."""
  hops = int(rng.integers(2, 5))
  names = distinct(lambda: "m_" + "".join(rng.choice(_CHAIN_NAMES, 2)), 2 * hops)
  values = distinct(lambda: _text_token(rng, "4"), 2)
  facts, depths = [], []
  for c in range(2):
    chain = names[c * hops:(c + 1) * hops]
    facts += [f"Let {chain[0]} be {values[c]}. "] + [
        f"Set {b} to {a}. " for a, b in zip(chain, chain[1:])]
    depths += sorted(rng.uniform(0, 1, hops))
  pieces = [(f"Which names hold {values[0]}? ", False),
            (", ".join(names[:hops]), True), (". ", False)]
  room = target_bytes - sum(map(len, facts)) - sum(len(t) for t, _ in pieces)
  if room < 0:     # a short document: the chains do not fit, a plain passkey does
    return passkey_document(rng, target_bytes, split)
  text, cuts = text_hay(rng, room)
  return _from_pieces([(_insert(text, cuts, np.asarray(depths), facts), False)] + pieces)


def mixkey_document(rng: np.random.Generator, target_bytes: int, split: str = "train"
                    ) -> Document:
  """1-6 facts of a wording composed for this document (`retrieval_wording`) in
  ~target_bytes of pydoc text (the other keys' facts distract), one key possibly holding 2-4
  values, an optional header, then 1-2 questions with answer prefixes; the answer spans are
  the asked values. Too short for one fact and its question: a plain passkey document."""
  w = retrieval_wording.draw_wording(rng)
  n = int(rng.integers(1, 7))
  multi = int(rng.integers(2, 5)) if rng.uniform() < 0.15 else 1   # values of keys[0]
  keys = distinct(lambda: _text_token(rng, w.key_kind), n)
  values = distinct(lambda: _text_token(rng, w.value_kind), n - 1 + multi, avoid=keys)
  owners = [0] * multi + list(range(1, n))
  facts = [(k, w.fact(keys[k], v)) for k, v in zip(owners, values)]   # keys[0]'s first
  asked = [0] + ([int(rng.integers(1, n))] if n > 1 and rng.uniform() < 0.25 else [])
  pieces = []
  for j in asked:
    several = j == 0 and multi > 1
    pieces += [(w.ask(rng, keys[j], several), False),
               (", ".join(values[:multi]) if several else values[multi - 1 + j], True),
               (". ", False)]
  header = w.header(rng) if rng.uniform() < 0.5 else ""
  # Too long: drop the header, then distractors (never an asked key's facts), then give up.
  while (room := target_bytes - len(header) - sum(len(t) for _, t in facts)
         - sum(len(t) for t, _ in pieces)) < 0:
    spare = [i for i, (k, _) in enumerate(facts) if k not in asked]
    if header:
      header = ""
    elif spare:
      facts.pop(spare[-1])
    else:
      return passkey_document(rng, target_bytes, split)
  text, cuts = text_hay(rng, room)
  depths = rng.uniform(0, 1, len(facts))
  depths[:multi] = np.sort(depths[:multi])   # keys[0]'s values in the order they are listed
  body = _insert(text, cuts, depths, [t for _, t in facts])
  return _from_pieces([(header + body, False)] + pieces)


_MAKERS = {"passkey": passkey_document, "multikey": multikey_document, "kv": kv_document,
           "textkey": textkey_document, "textchain": textchain_document,
           "mixkey": mixkey_document}


class RetrievalSource:
  """`num_documents` synthetic documents of ~`target_bytes` bytes, cycling through `kinds`.

  Args:
    target_bytes: the longest document in bytes (e.g. a stage's seq_len minus BOS/EOS).
    min_bytes: the shortest (default target_bytes: all alike); document i's length is drawn
      uniformly in [min_bytes, target_bytes] (`lengths`), so a row packs several short ones:
      more retrieval examples per token, at every distance up to the row.
    seed: documents depend only on (split, seed, index).
    num_documents: the virtual length (one "epoch").
    kinds: which generators to cycle through (`KINDS`).
    split: "train" (the curriculum's) or "eval" (held-out keys and seed stream).
    answer_weight: the loss weight of the answer tokens (`Document.answer_weight`; > 0).
  """

  def __init__(self, target_bytes: int, *, min_bytes: int | None = None, seed: int = 0,
               num_documents: int = 1 << 16, kinds: tuple[str, ...] = DEFAULT_KINDS,
               split: str = "train", answer_weight: float = 1.0):
    if target_bytes < 64:
      raise ValueError(f"retrieval documents need target_bytes >= 64, got {target_bytes}")
    min_bytes = target_bytes if min_bytes is None else min_bytes
    if not 64 <= min_bytes <= target_bytes:
      raise ValueError(f"retrieval min_bytes must be in [64, target_bytes={target_bytes}], "
                       f"got {min_bytes}")
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
      raise ValueError(f"retrieval kinds must be among {KINDS}, got {kinds}")
    _check_split(split)
    if not answer_weight > 0:
      raise ValueError(f"retrieval answer_weight must be > 0, got {answer_weight}")
    self.answer_weight = float(answer_weight)
    self.target_bytes, self.seed, self.kinds, self.split = target_bytes, seed, tuple(kinds), split
    self.num_documents = num_documents
    lengths_rng = np.random.default_rng([len(SPLITS) + SPLITS.index(split), seed])
    self.lengths = lengths_rng.integers(min_bytes, target_bytes + 1, num_documents).astype(
        np.int64)

  def __len__(self) -> int:
    return self.num_documents

  def __getitem__(self, i) -> Document:
    i = int(i)
    if not 0 <= i < self.num_documents:
      raise IndexError(f"document index {i} out of range for {self.num_documents} documents")
    kind = self.kinds[i % len(self.kinds)]
    doc = _MAKERS[kind](rng_for(self.split, self.seed, i), int(self.lengths[i]), self.split)
    doc.answer_weight = self.answer_weight
    return doc
