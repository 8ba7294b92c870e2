"""`mixkey` retrieval documents: key -> value facts whose wording is composed per document.

A model that only ever sees one needle wording ("The pass key is 48213.") learns that wording,
not retrieval: the RULER-style suite (`evals.ruler_tasks`), in other words, scores 0 for it.
Here every part of a document's wording is drawn independently: the fact's noun and adjective
("backup code", "ticket", "assigned value"), the word tying it to its key ("for", "of",
"linked to"), the verb ("is", "equals", ":"), the needle's opening ("One", "Note: the", ...),
an optional header announcing the facts, the question's form and place ("... mentioned
earlier?") and the answer's prefix (the fact's phrase again, "Answer:", ...). Keys and values
are of random kinds (word pairs, numbers of 3-9 digits, UUID-like and hex ids, words), the
other needles are distractors of the same shape, and one key may hold several values. The
hay is pydoc text with its own numbers (`retrieval.text_hay`); `retrieval.mixkey_document`
builds the documents from the wording drawn here. Of the order of 10^7 wordings
before keys and values: what stays constant is only "find the asked key, copy its value".

The evaluation suite's own strings never occur, by construction: its adjective "special" (and
RULER's "magic") is not in the lists, nor its "in the text above" (test_retrieval_data checks
generated documents against the suite's templates).

  header?  hay ... "Note: the backup code linked to river-stone equals 4417203. " ... hay
           "\\nWhich backup code is linked to river-stone, as stated earlier? "
           "The backup code linked to river-stone equals 4417203. "
"""

from __future__ import annotations

import dataclasses

import numpy as np

ADJECTIVES = ("", "", "secret", "hidden", "private", "main", "lucky", "chosen", "unique",
              "backup", "master", "personal", "assigned", "current", "reserved", "official",
              "final", "stored", "marked", "registered", "rare", "true", "old", "new")
NOUNS = ("number", "code", "key", "pass key", "value", "id", "token", "pin", "tag", "label",
         "serial", "password", "figure", "entry", "answer", "code word", "reference", "ticket",
         "account number", "digit string", "record", "identifier")
TIES = ("for", "of", "belonging to", "linked to", "tied to", "assigned to", "for the item",
        "of the entry")
VERBS = ("is", "was", "equals", "reads", "is set to", ":", "=", "is given as")
OPENINGS = ("One", "The", "A", "Note: the", "Remember that the", "Keep in mind: the",
            "Here, the", "By the way, the", "Recorded: the", "")
PLACES = ("", " in the passage above", " in the document above", " mentioned earlier",
          " given above", " in the notes above", " from the passage", " in this document",
          " stated before", " in the material above", " that was written down")
QUESTIONS = ("What is the {p}{place}?", "Which is the {p}{place}?", "Tell me the {p}{place}.",
             "Find the {p}{place}.", "Recall the {p}{place}.", "Question: what is the {p}"
             "{place}?", "Look up the {p}{place}.", "What was the {p}{place}?")
MULTI_QUESTIONS = ("What are all the {p}s{k}{place}?", "List every {p}{k}{place}.",
                   "Give all the {p}s{k}{place}.")
HEADERS = ("{A}{n}s are {hidden} in the {doc} below. {Remember} them{after}\n",
           "The {doc} below contains some {a}{n}s. {Remember} them{after}\n",
           "Read the {doc} below; {a}{n}s are {hidden} in it{after}\n")
_HIDDEN = ("hidden", "placed", "written", "scattered", "mentioned", "stored")
_DOCS = ("passage", "document", "notes", "page", "material", "text")
_REMEMBER = ("Remember", "Memorize", "Keep track of", "Note", "Look out for")
_AFTER = (".", ": questions follow.", "; you will be asked about them afterwards.",
          ", a question comes at the end.", ".")
SEPARATORS = ("\n", " ", "\n\n", "\n")
KEY_KINDS = ("hyphen", "words", "word", "7", "5", "uuid", "hex")
VALUE_KINDS = ("7", "7", "7", "3", "5", "6", "9", "uuid", "hex", "word", "hyphen")


def _pick(rng: np.random.Generator, options):
  return options[int(rng.integers(len(options)))]


def _cap(text: str) -> str:
  return text[:1].upper() + text[1:]


@dataclasses.dataclass(frozen=True)
class Wording:
  """One document's wording: its fact phrase ("<adj> <noun>"), tie, verb, needle opening and
  the kinds of its keys and values; `ask` and `header` draw the rest per use."""
  adj: str
  noun: str
  tie: str
  verb: str
  opening: str
  key_kind: str
  value_kind: str

  @property
  def phrase(self) -> str:
    return f"{self.adj} {self.noun}".strip()

  @property
  def sep(self) -> str:   # "code for K: 5", "code for K is 5"
    return "" if self.verb in (":", "=") else " "

  def fact(self, key: str, value: str) -> str:
    lead = f"{self.opening} {self.phrase}" if self.opening else _cap(self.phrase)
    return f"{lead} {self.tie} {key}{self.sep}{self.verb} {value}. "

  def ask(self, rng: np.random.Generator, key: str, several: bool) -> str:
    """The text before an answer: a separator, a question about `key` (`several`: all its
    values) and an answer prefix."""
    place, key_phrase = _pick(rng, PLACES), f"{self.phrase} {self.tie} {key}"
    if several:
      q = _pick(rng, MULTI_QUESTIONS).format(p=self.phrase, k=f" {self.tie} {key}", place=place)
      prefix = _pick(rng, (f"The {self.phrase}s {self.tie} {key} are ", "Answer: "))
    else:
      q = _pick(rng, QUESTIONS).format(p=key_phrase, place=place)
      said = f"{key_phrase}{self.sep}{self.verb} "
      prefix = _pick(rng, (f"The {said}",) * 3 + (
          "Answer: ", f"Answer: the {said}", f"It {self.verb} " if self.sep else "Answer: "))
    return _pick(rng, SEPARATORS) + q + " " + prefix

  def header(self, rng: np.random.Generator) -> str:
    """A line announcing the facts ("Backup codes are hidden in the notes below. ...")."""
    a = f"{self.adj} " if self.adj else ""
    return _pick(rng, HEADERS).format(
        A=_cap(a) if a else _pick(rng, ("Some ", "Several ", "A few ")), a=a, n=self.noun,
        hidden=_pick(rng, _HIDDEN), doc=_pick(rng, _DOCS), Remember=_pick(rng, _REMEMBER),
        after=_pick(rng, _AFTER))


def draw_wording(rng: np.random.Generator) -> Wording:
  """A wording with every part drawn independently."""
  return Wording(adj=_pick(rng, ADJECTIVES), noun=_pick(rng, NOUNS), tie=_pick(rng, TIES),
                 verb=_pick(rng, VERBS), opening=_pick(rng, OPENINGS),
                 key_kind=_pick(rng, KEY_KINDS), value_kind=_pick(rng, VALUE_KINDS))
