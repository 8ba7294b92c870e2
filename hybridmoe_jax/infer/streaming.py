"""Generated ids -> text as it can be shown: incremental detokenization with stop strings.

`TextStream(tokenizer, stop)` takes ids as they are drawn (`push`) and returns the new text
that is safe to show: text that cannot change any more. Two things hold text back:
  - a multi-byte character whose bytes have not all arrived (the byte tokenizer, byte-level
    BPE): decoding shows it as U+FFFD at the end, so trailing U+FFFD waits for the next id;
  - a possible start of a stop string: the longest end of the text that is a prefix of a
    stop string waits until it either completes the stop string or stops matching.
When a stop string appears, the text is cut before it and `stopped` becomes True (the caller
stops generating). `finish()` releases what was held back. The concatenated deltas always
equal `text`, which equals the whole decode cut at the first stop string: streamed and
non-streamed outputs are the same text (api.generate, the server and the chat REPL all use
this class).
"""

from __future__ import annotations

from typing import Iterable, Sequence


class TextStream:
  """Incremental detokenizer of one generated sequence (see the module docstring).

  Args:
    tokenizer: anything with `decode(ids) -> str`.
    stop: strings that end the text (empty strings are ignored).
  """

  def __init__(self, tokenizer, stop: Sequence[str] = ()):
    self.tokenizer = tokenizer
    self.stop = tuple(s for s in stop if s)
    self.ids: list[int] = []
    self.stopped = False
    self._sent = ""

  @property
  def text(self) -> str:
    """The text released so far (after `finish`, the whole output)."""
    return self._sent

  def push(self, ids: int | Iterable[int]) -> str:
    """Add generated ids -> the newly releasable text ("" when nothing is, or after a stop
    string)."""
    if self.stopped:
      return ""
    self.ids.extend([int(ids)] if isinstance(ids, int) else (int(i) for i in ids))
    return self._release(final=False)

  def finish(self) -> str:
    """The text still held back (the sequence has ended)."""
    return "" if self.stopped else self._release(final=True)

  def _release(self, final: bool) -> str:
    text = self.tokenizer.decode(self.ids) if self.ids else ""
    hits = [text.find(s) for s in self.stop if s in text]
    if hits:
      end, self.stopped = min(hits), True
    else:
      end = len(text)
      if not final:
        while end > len(self._sent) and text[end - 1] == "\ufffd":
          end -= 1      # an incomplete multi-byte character: wait for its other bytes
        unsent = end - len(self._sent)        # a held-back prefix lies in the unsent text
        end -= max((k for s in self.stop for k in range(1, min(len(s), unsent + 1))
                    if text[end - k:end] == s[:k]), default=0)
    # Earlier text never changes for the tokenizers here (decode of a prefix is a prefix).
    delta = text[len(self._sent):end] if end > len(self._sent) else ""
    self._sent += delta
    return delta


def stream_text(tokenizer, ids: Iterable[int], stop: Sequence[str] = ()) -> str:
  """The whole text of `ids` cut at the first stop string (TextStream in one call)."""
  stream = TextStream(tokenizer, stop)
  stream.push(ids)
  stream.finish()
  return stream.text
