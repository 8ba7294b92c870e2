"""Bad records, judged in one place for every source (sources.py, record_sources.py).

`BadRecords` counts and warns ("skip") or raises `BadRecordError` ("error"), as
`data.bad_records` says; `text_problem`, `decode_utf8` and `parse_jsonl_line` say what is
wrong with a document, as a (reason counted in warnings, one-line detail) pair.
"""

from __future__ import annotations

import collections
import json

from absl import logging

from hybridmoe_jax.config.run import BAD_RECORD_MODES

_MAX_LOCATIONS = 3  # bad-record locations quoted in a skip warning
_HINT = "set data.bad_records=skip to skip bad records"
Problem = tuple[str, str]  # (reason counted in warnings, one-line detail)


class BadRecordError(ValueError):
  """A bad input record with data.bad_records = "error"; the message is one line."""


def check_index(i, n: int) -> int:
  """int(i), negative counted from the end; IndexError outside [0, n)."""
  i = int(i)  # grain may pass numpy integers
  if i < 0:
    i += n
  if not 0 <= i < n:
    raise IndexError(f"document index {i} out of range for {n} documents")
  return i


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}


def _json_type(value) -> str:
  return _JSON_TYPES.get(type(value), type(value).__name__)


def text_problem(text) -> Problem | None:
  """Why `text` cannot be a document (not a str, empty, not encodable as UTF-8), or None."""
  if not isinstance(text, str):
    return "text not a string", f"text is {_json_type(text)}, not a string"
  if not text.strip():
    return "empty text", "text is empty or whitespace only"
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    return ("lone surrogate", f"text holds a lone surrogate U+{ord(text[e.start]):04X} at "
            f"character {e.start} (not encodable as UTF-8)")
  return None


def decode_utf8(data: bytes) -> tuple[str | None, Problem | None]:
  """(text, None), or (None, problem) naming the first byte that is not valid UTF-8."""
  try:
    return data.decode("utf-8"), None
  except UnicodeDecodeError as e:
    return None, ("not valid UTF-8", f"not valid UTF-8 (byte 0x{data[e.start]:02x} at byte "
                  f"{e.start})")


def parse_jsonl_line(line: bytes, field: str) -> tuple[str | None, Problem | None]:
  """One JSONL line -> (its document text, None), or (None, why it is a bad record).

  Args:
    line: the raw line, with or without its newline.
    field: the key holding the text.
  """
  s, problem = decode_utf8(line)
  if problem:
    return None, problem
  try:
    # strict=False: raw control characters inside strings (tabs, NUL) are legal text here.
    record = json.loads(s.lstrip("\ufeff"), strict=False)
  except ValueError as e:
    cut = "" if line.endswith(b"\n") else "; the file's last line has no newline: truncated?"
    return None, ("malformed JSON", f"malformed JSON ({getattr(e, 'msg', e)}, column "
                  f"{getattr(e, 'colno', '?')}){cut}")
  except RecursionError:
    return None, ("malformed JSON", "malformed JSON (nested too deeply to parse)")
  if not isinstance(record, dict):
    return None, ("not a JSON object", f"the line holds {_json_type(record)}, not a JSON object")
  if field not in record:
    return None, (f"no {field!r} field", f"the object has no {field!r} field")
  text = record[field]
  if not isinstance(text, str):
    return None, (f"{field!r} not a string", f"{field!r} is {_json_type(text)}, not a string")
  problem = text_problem(text)
  return (None, problem) if problem else (text, None)


class BadRecords:
  """The one place bad records are handled: counted and warned about, or raised.

  Args:
    what: the input, for the warning ("/x/y.jsonl", "['/x/texts']").
    mode: "skip" or "error" (data.bad_records).
    unit: what a record is ("lines", "text files"), for the warning.
  """

  def __init__(self, what: str, mode: str, unit: str):
    if mode not in BAD_RECORD_MODES:
      raise ValueError(f"bad_records must be one of {BAD_RECORD_MODES}, got {mode!r}")
    self.what, self.mode, self.unit = what, mode, unit
    self.counts: collections.Counter[str] = collections.Counter()
    self.locations: list[str] = []

  def add(self, where: str, problem: Problem) -> None:
    """Records one bad record at `where` ("/x/y.jsonl line 7", "/x/a.txt").

    Raises:
      BadRecordError: in "error" mode, one line: where, what is wrong, how to skip instead.
    """
    reason, detail = problem
    if self.mode == "error":
      raise BadRecordError(f"{where}: {detail}; {_HINT}")
    self.counts[reason] += 1
    if len(self.locations) < _MAX_LOCATIONS:
      self.locations.append(f"{where} ({detail})")

  def warn(self, total: int) -> None:
    """Logs one warning line (if anything was skipped): counts per reason, first locations."""
    if not self.counts:
      return
    n = sum(self.counts.values())
    detail = ", ".join(f"{k} {reason}" for reason, k in sorted(self.counts.items()))
    more = ", ..." if n > len(self.locations) else ""
    logging.warning("data: skipped %d of %d %s in %s (%s); first: %s%s", n, total, self.unit,
                    self.what, detail, "; ".join(self.locations), more)
