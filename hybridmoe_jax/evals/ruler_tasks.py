"""RULER-style prompts (Hsieh et al. 2024, arXiv:2404.06654), written from the paper's task
definitions: needle retrieval (single, multi-key with distractor needles of the same shape,
multi-value, multi-query), multi-hop tracing (variable tracking) and aggregation (common- and
frequent-words extraction). The wording is this project's own. Two diagnostics, "passkey" and
"passkey_multikey", keep the retrieval recipe's training wording on the held-out haystack.

Every prompt is token ids of exactly the requested length for the given tokenizer: BOS, a
header, the context, the question with its answer prefix. Each piece (sentence, needle,
list item) is tokenized alone and the ids are joined, so lengths are counted in the model's
tokens and the haystack is cut to fill the budget exactly. The haystack is held-out prose
(`ruler_text`), read as a run of consecutive sentences from a random start; it holds ordinary
numbers, so a digit key is not the only number in the prompt. A value that occurs in the
haystack by chance is redrawn.

Scoring (`string_match_all`, RULER's recall): per prompt, the fraction of reference strings
found (case-insensitive substring) in the model's continuation.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Callable, Iterator

import numpy as np

from hybridmoe_jax.data import retrieval
from hybridmoe_jax.data.tokenizers.base import Tokenizer
from hybridmoe_jax.evals import ruler_text

VALUE_DIGITS = 7          # RULER's numbers are 7 digits
KEY_KINDS = ("words", "digits", "uuid")
_KIND_NAMES = {"words": "word", "digits": "number", "uuid": "id"}
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
_UPPER = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
_HEX = np.array(list("0123456789abcdef"))
# The NIAH wording ({v} the value's kind name, {k} the key(s), {x} the value). Training never
# sees it: `data.retrieval_wording` composes other wordings, and test_retrieval_data checks
# that no training document holds a fragment of these.
NIAH_TEMPLATES = {
    "header": ("Special {v}s are hidden in the text below. Remember them: you will be asked "
               "about them after the text.\n"),
    "needle": "One special {v} for {k} is {x}. ",
    "question": "\nWhat is the special {v} for {k} in the text above? The special {v} for {k} is ",
    "question_all": ("\nWhat are all the special {v}s for {k} in the text above? The special "
                     "{v}s for {k} are "),
}


@dataclasses.dataclass(frozen=True)
class Spec:
  """One task: its family and that family's sizes."""
  family: str               # niah / vt / cwe / fwe, or passkey (the recipe's own wording)
  keys: str = "words"        # niah: the kind of key (KEY_KINDS)
  values: str = "digits"     # niah: the kind of value (KEY_KINDS)
  needles: int = 1           # niah: distinct keys written (1 queried, the rest distract)
  values_per_key: int = 1    # niah: multi-value
  queries: int = 1           # niah: keys asked at once (multi-query)
  hops: int = 4              # vt: assignments after the first
  chains: int = 1            # vt: chains (the others distract)
  common: int = 10           # cwe: words to find; fwe: top words asked (3)
  freq_common: int = 30      # cwe
  freq_uncommon: int = 3     # cwe
  alpha: float = 2.0         # fwe: Zipf exponent
  fwe_vocab: int = 50        # fwe: coded words


TASKS = {
    "niah_single": Spec("niah"),
    "niah_single_uuid": Spec("niah", keys="digits", values="uuid"),
    "niah_multikey": Spec("niah", needles=4),
    "niah_multikey_uuid": Spec("niah", keys="uuid", values="uuid", needles=4),
    "niah_multivalue": Spec("niah", values_per_key=4),
    "niah_multiquery": Spec("niah", needles=4, queries=4),
    "vt": Spec("vt"),
    "cwe": Spec("cwe"),
    "fwe": Spec("fwe", common=3),
    # Diagnostics in the training wording (not RULER's), on the held-out haystack:
    "passkey": Spec("passkey"),
    "passkey_multikey": Spec("passkey", needles=4),
}


@dataclasses.dataclass(frozen=True)
class Example:
  task: str
  prompt: np.ndarray               # int32 [length]: BOS, header, context, question
  answers: tuple[str, ...]         # the references (all must appear for a full score)


def string_match_all(prediction: str, answers) -> float:
  """RULER's recall: the fraction of `answers` found in `prediction` (case-insensitive)."""
  p = prediction.lower()
  return float(np.mean([a.lower() in p for a in answers])) if answers else float("nan")


Pieces = Callable[[str], np.ndarray]   # a text piece -> its token ids int32 (`new_pieces`)


def new_pieces(tok: Tokenizer) -> Pieces:
  """Token ids of text pieces, memoised for `tok` (a haystack repeats its sentences: share
  one across the prompts of a run)."""
  return functools.cache(lambda text: np.asarray(tok.encode(text), np.int32))


def draw_key(rng: np.random.Generator, kind: str, vocab) -> str:
  """A key or value: "words" two vocabulary words "word-word", "digits" VALUE_DIGITS digits
  (no leading zero), "uuid" 8-4-4-4-12 hex."""
  if kind == "words":
    a, b = rng.choice(len(vocab), 2, replace=False)
    return f"{vocab[a]}-{vocab[b]}"
  if kind == "digits":
    return str(int(rng.integers(10 ** (VALUE_DIGITS - 1), 10 ** VALUE_DIGITS)))
  if kind == "uuid":
    h = "".join(rng.choice(_HEX, 32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
  raise ValueError(f"ruler key kind must be one of {KEY_KINDS}, got {kind!r}")


def fill_haystack(texts: Iterator[str], pieces: Pieces, budget: int):
  """The haystack of these prompts and of the passkey NIAH (`evals.niah`): the ids of
  sentences taken from `texts` in order until `budget` tokens, the last one cut -> (ids
  [budget], sentence boundaries incl. 0 and budget, the sentences' text)."""
  parts, cuts, used, n = [], [0], [], 0
  while n < budget:
    text = next(texts)
    ids = pieces(text)[:budget - n]
    parts.append(ids)
    used.append(text)
    n += len(ids)
    cuts.append(n)
  hay = np.concatenate(parts) if parts else np.zeros(0, np.int32)
  return hay, sorted(set(cuts)), "".join(used)


def _haystack(task: str, rng, length: int, pieces: Pieces, split: str, parts):
  """`fill_haystack` of consecutive held-out sentences from a random start, filling what BOS
  and `parts` (id arrays) leave of `length` (a ValueError when they do not fit)."""
  budget = length - 1 - sum(map(len, parts))
  if budget < 0:
    raise _too_short(task, length, length - budget)
  sents = ruler_text.sentences(split)
  start = int(rng.integers(len(sents)))
  return fill_haystack((sents[i % len(sents)] for i in itertools.count(start)), pieces, budget)


def nearest_cut(cuts, depth: float, length: int) -> int:
  """The sentence boundary (of `cuts`, sorted) nearest depth * length; the first of a tie."""
  cuts = np.asarray(cuts)
  return int(cuts[np.argmin(np.abs(cuts - depth * length))])


def _insert(hay: np.ndarray, cuts, depths, items: list[np.ndarray]) -> np.ndarray:
  """`items` inserted at the sentence boundaries nearest depth * len(hay), in depth order
  (ties keep the items' order)."""
  at = [nearest_cut(cuts, d, len(hay)) for d in depths]
  out, prev = [], 0
  for j in np.argsort(at, kind="stable"):
    out += [hay[prev:at[j]], items[j]]
    prev = at[j]
  return np.concatenate(out + [hay[prev:]]).astype(np.int32)


def _assemble(tok: Tokenizer, length: int, task: str, parts: list[np.ndarray]) -> np.ndarray:
  prompt = np.concatenate([np.asarray([tok.bos_id], np.int32)] + parts).astype(np.int32)
  assert len(prompt) == length, (task, len(prompt), length)
  return prompt


def _too_short(task: str, length: int, need: int) -> ValueError:
  return ValueError(f"ruler task {task}: length {length} is too short for its needles and "
                    f"question (needs >= {need} tokens with this tokenizer)")


def _join(words) -> str:
  words = list(words)
  return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _niah(task, s: Spec, rng, length, tok, pieces, split) -> Example:
  vocab = ruler_text.vocabulary(split)
  vname = _KIND_NAMES[s.values]
  keys = retrieval.distinct(lambda: draw_key(rng, s.keys, vocab), s.needles)
  values = retrieval.distinct(lambda: draw_key(rng, s.values, vocab), s.needles * s.values_per_key)
  needles = [(k, values[i * s.values_per_key + j]) for i, k in enumerate(keys)
             for j in range(s.values_per_key)]
  asked = keys[:s.queries]              # the others are distractors of the same shape
  answers = tuple(v for k, v in needles if k in asked)
  header = NIAH_TEMPLATES["header"].format(v=vname)
  one = s.queries == 1 and s.values_per_key == 1
  question = NIAH_TEMPLATES["question" if one else "question_all"].format(
      v=vname, k=asked[0] if one else _join(asked))
  items = [pieces(NIAH_TEMPLATES["needle"].format(v=vname, k=k, x=v)) for k, v in needles]
  order = rng.permutation(len(items))
  return _in_haystack(task, rng, length, tok, pieces, split, header, question,
                      [items[j] for j in order], None, [v for _, v in needles], answers)


def _in_haystack(task, rng, length, tok, pieces, split, header, question, items, depths,
                 values, answers):
  """BOS, header, the held-out haystack with `items` at `depths` (None: uniform random),
  question: exactly `length`. None (draw again) when a value occurs in the haystack."""
  fixed = [pieces(header), pieces(question)]
  hay, cuts, text = _haystack(task, rng, length, pieces, split, fixed + items)
  if any(v in text for v in values):
    return None
  depths = rng.uniform(0, 1, len(items)) if depths is None else depths
  body = _insert(hay, cuts, depths, items)
  return Example(task, _assemble(tok, length, task, [fixed[0], body, fixed[1]]), answers)


def _passkey(task, s: Spec, rng, length, tok, pieces, split) -> Example:
  """The retrieval recipe's own wording (`data.retrieval`: "The pass key is 48213. Remember
  it." / named needles with distractors) on the held-out haystack, keys from its evaluation
  key space: separates "retrieves on text it never saw" from "follows a new wording"."""
  if s.needles == 1:
    keys = [retrieval.draw_key(rng, "eval")]
    items, question = [retrieval.needle_text(keys[0])], retrieval.QUESTION
  else:
    names = [retrieval.NAMES[j] for j in rng.choice(len(retrieval.NAMES), s.needles,
                                                    replace=False)]
    keys = retrieval.distinct(lambda: retrieval.draw_key(rng, "eval"), s.needles)
    items = [retrieval.named_needle(nm, k) for nm, k in zip(names, keys)]
    question = retrieval.named_question(names[0])
  return _in_haystack(task, rng, length, tok, pieces, split, "", question,
                      [pieces(t) for t in items], None, keys, (keys[0],))


def _vt(task, s: Spec, rng, length, tok, pieces, split) -> Example:
  names = retrieval.distinct(lambda: "".join(rng.choice(_UPPER, 5)), s.chains * (s.hops + 1))
  values = retrieval.distinct(lambda: draw_key(rng, "digits", ()), s.chains)
  items, depths = [], []
  for c in range(s.chains):
    chain = names[c * (s.hops + 1):(c + 1) * (s.hops + 1)]
    text = [f"VAR {chain[0]} = {values[c]}. "] + [
        f"VAR {b} = VAR {a}. " for a, b in zip(chain, chain[1:])]
    items += [pieces(t) for t in text]
    depths += sorted(rng.uniform(0, 1, len(text)))   # a chain is read in order
  answers = tuple(names[:s.hops + 1])
  header = "Remember the variable assignments in the text below; a question follows.\n"
  question = (f"\nWhich variables are assigned the value {values[0]} in the text above? "
              f"The variables assigned the value {values[0]} are ")
  return _in_haystack(task, rng, length, tok, pieces, split, header, question, items,
                      depths, values, answers)


def _fill(task, rng, length, tok, pieces, split, header, question, items):
  """BOS, held-out prose filling the gap, header, the items, question: exactly `length`."""
  fixed = [pieces(header), pieces(question)]
  prose, _, _ = _haystack(task, rng, length, pieces, split, fixed + items)
  return _assemble(tok, length, task, [prose, fixed[0]] + items + [fixed[1]])


def _cwe(task, s: Spec, rng, length, tok, pieces, split) -> Example:
  """Common words: `common` words `freq_common` times each among words `freq_uncommon`
  times each, shuffled into a numbered list; the number of uncommon words grows with the
  length (the common ones' count is fixed). Below ~2.5K tokens the common words' frequency
  is lowered (at least freq_uncommon + 2) so the list fits; past the vocabulary's size the
  list stops growing and held-out prose fills the rest."""
  vocab = ruler_text.vocabulary(split)
  header = "\nBelow is a numbered list of words. Some of them appear many times.\n"
  question = (f"\nWhat are the {s.common} most common words in the list above? "
              f"The {s.common} most common words in the list are ")
  room = length - 1 - len(pieces(header)) - len(pieces(question))
  # The shortest list at its longest (the longest words, 3-digit numbers) must fit, so a
  # length is accepted or refused whatever words are drawn.
  least = s.common * (s.freq_uncommon + 2)
  widest = len(max(vocab, key=len))   # once, not per word (quadratic: 0.3 s a prompt)
  longest = max(len(pieces(f"{least}. {w} ")) for w in vocab if len(w) == widest)
  if least * longest > room:
    raise _too_short(task, length, length - room + least * longest)
  per_item = np.mean([len(pieces(f"{i}. {w} ")) for i, w in
                      zip(range(100, 110), vocab[:10])]) + 0.5
  fit = int(room / per_item)
  freq = int(min(s.freq_common, max(s.freq_uncommon + 2, fit // 2 // s.common)))
  n_unc = int(min(len(vocab) - s.common, max(0, (fit - s.common * freq) // s.freq_uncommon)))
  words = [vocab[j] for j in rng.choice(len(vocab), s.common + n_unc, replace=False)]
  while True:
    bag = [w for w in words[:s.common] for _ in range(freq)] + [
        w for w in words[s.common:s.common + n_unc] for _ in range(s.freq_uncommon)]
    bag = [bag[j] for j in rng.permutation(len(bag))]
    items = [pieces(f"{i + 1}. {w} ") for i, w in enumerate(bag)]
    if sum(map(len, items)) <= room:
      break
    if n_unc > 0:                                  # too long: fewer uncommon words,
      n_unc = max(0, n_unc - max(1, n_unc // 20))
    else:                                          # then fewer repeats of the common ones
      freq -= 1                                    # (>= freq_uncommon + 2 fits: see above)
  prompt = _fill(task, rng, length, tok, pieces, split, header, question, items)
  return Example(task, prompt, tuple(words[:s.common]))


def _fwe(task, s: Spec, rng, length, tok, pieces, split) -> Example:
  """Frequent words: coded words (5 random letters) drawn from a Zipf law of exponent alpha
  over `fwe_vocab` words until the budget is full; the answer is the `common` (3) most
  frequent. Redrawn when the third and fourth tie."""
  header = "\nBelow is a coded text. Keep count of how often each coded word appears.\n"
  question = (f"\nWhat are the {s.common} most frequent coded words in the text above? "
              f"The {s.common} most frequent coded words are ")
  room = length - 1 - len(pieces(header)) - len(pieces(question))
  vocab = retrieval.distinct(lambda: "".join(rng.choice(_LETTERS, 5)), s.fwe_vocab)
  ranks = np.arange(1, s.fwe_vocab + 1)
  p = ranks ** -s.alpha / np.sum(ranks ** -s.alpha)
  items, n = [], 0
  while True:
    w = vocab[int(rng.choice(s.fwe_vocab, p=p))]
    ids = pieces(w + " ")
    if n + len(ids) > room:
      break
    items.append((w, ids))
    n += len(ids)
  top = collections.Counter(w for w, _ in items).most_common()   # ties: first seen first
  if len(top) <= s.common or top[s.common - 1][1] == top[s.common][1]:
    return None
  prompt = _fill(task, rng, length, tok, pieces, split, header, question,
                 [ids for _, ids in items])
  return Example(task, prompt, tuple(w for w, _ in top[:s.common]))


_BUILD = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe, "passkey": _passkey}


def make_example(task: str, rng: np.random.Generator, length: int, tok: Tokenizer,
                 split: str = "test", pieces: Pieces | None = None) -> Example:
  """One prompt of `task` with exactly `length` tokens of `tok`, from `split`'s haystack.

  Raises:
    ValueError: unknown task, or a length too short for the task's fixed parts.
  """
  if task not in TASKS:
    raise ValueError(f"unknown ruler task {task!r}: allowed {tuple(TASKS)}")
  pieces = pieces or new_pieces(tok)
  spec = TASKS[task]
  for _ in range(100):   # a value found in the haystack, or a tie: draw again
    ex = _BUILD[spec.family](task, spec, rng, length, tok, pieces, split)
    if ex is not None:
      return ex
  raise ValueError(f"ruler task {task}: no valid prompt in 100 draws at length {length}")
