"""OpenAI request bodies -> checked dataclasses; responses and errors in OpenAI's shapes.

Only JSON-level checks live here (types, ranges, unsupported options); what needs the model
(prompt length against the cache, token ids against the vocabulary, the tokenizer's chat
roles) is checked in app.py. Every bad field raises `ApiError(status, message, param)`,
rendered as OpenAI's error object {"error": {"message", "type", "param", "code"}}.

`load_json(raw)` is the only way a body becomes a value: NaN, +-Infinity, floats that
overflow to infinity, integers of more than 20 digits, strings with lone surrogates and
nesting deeper than MAX_DEPTH are refused there with the field's path, so the parsers below
(and the tokenizer, numpy, the sampler) only ever see finite numbers, encodable text and a
shallow tree.

Tool calls: our chat format (rl/chat_format.py) gives a tool ONE free-text argument
("<tool_call> name argument <end_turn>"). On the wire it is
`function.arguments = json.dumps({"argument": text})`; a request's assistant tool call may
send that object or a bare JSON string.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np

from hybridmoe_jax.rl.chat_format import OPENAI_ROLES, Message, action_text
from hybridmoe_jax.rl.envs.base import Answer, ToolCall, ToolSpec

MAX_BODY_BYTES = 16 * 2**20   # the server's default body limit (--max_body_bytes)
MAX_DEPTH = 64          # levels of nested objects / lists a body may have
MAX_INT_DIGITS = 20     # 2**64 - 1 has 20: no field takes a longer integer
MAX_PROMPTS = 2048      # prompts in one /v1/completions list (each is one scheduler job)
MAX_STOP_CHARS = 1000   # characters per stop string (each is matched at every token)

# Numeric fields: name -> (low, high, integer, low excluded).
_RANGES = {
    "temperature": (0.0, 2.0, False, False),
    "top_p": (0.0, 1.0, False, True),
    "top_k": (0, 2**31 - 1, True, False),
    "seed": (-2**63, 2**64 - 1, True, False),
    "max_tokens": (1, 2**31 - 1, True, False),
    "max_completion_tokens": (1, 2**31 - 1, True, False),
}

# Accepted and ignored when at their neutral value; any other value is refused.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": None, "echo": False,
            "best_of": 1, "suffix": None, "logit_bias": None, "top_logprobs": None,
            "parallel_tool_calls": None}


class ApiError(Exception):
  """A request the server refuses: HTTP status, one-line message, the offending field."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def body(self) -> dict[str, Any]:
    kind = "invalid_request_error" if self.status < 500 else "server_error"
    return {"error": {"message": self.message, "type": kind, "param": self.param,
                      "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Sampling:
  """The generation settings shared by both endpoints (max_tokens None: fill the cache)."""
  max_tokens: int | None
  temperature: float
  top_p: float
  top_k: int
  seed: int
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
  model: str
  prompts: tuple[str | tuple[int, ...], ...]   # one choice per prompt
  sampling: Sampling


@dataclasses.dataclass(frozen=True)
class ChatRequest:
  model: str
  messages: tuple[Message, ...]
  tools: tuple[ToolSpec, ...]
  sampling: Sampling


def _fail(param: str, message: str) -> ApiError:
  return ApiError(400, f"{param}: {message}", param)


class _Refused:
  """A JSON constant or number `load_json` refuses, kept in the tree until its path is known."""

  def __init__(self, why: str):
    self.why = why


def _float(text: str) -> float | _Refused:
  value = float(text)
  return value if value - value == 0 else _Refused(f"{text} overflows to infinity")


def _int(text: str) -> int | _Refused:
  digits = len(text.lstrip("-"))
  if digits > MAX_INT_DIGITS:      # also keeps int() below Python's 4300-digit limit
    return _Refused(f"an integer of {digits} digits is out of range (no field takes more "
                    f"than {MAX_INT_DIGITS})")
  return int(text)


def _nonfinite(text: str) -> _Refused:
  return _Refused(f"{text} is not allowed: numbers must be finite")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _path(keys: tuple) -> str:
  """("messages", 0, "content") -> "messages[0].content"."""
  out = ""
  for k in keys:
    out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
  return out or "the request body"


def _refuse(keys: tuple, why: str) -> ApiError:
  name = _path(keys)
  if len(keys) == 1 and keys[0] in _RANGES:
    why += f"; allowed {_allowed(keys[0])}"
  return ApiError(400, f"{name}: {why}", name if keys else None)


def load_json(raw: bytes) -> Any:
  """A request body -> its JSON value, or ApiError(400) naming the first bad field.

  Guaranteed of the value returned: nested at most MAX_DEPTH levels; every float finite
  (NaN, Infinity, -Infinity and overflowing literals like 1e999 are refused); every int of
  at most MAX_INT_DIGITS digits; every string (keys too) encodable as UTF-8 (no lone
  surrogates from "\\ud800" escapes). A body nested deep enough to exhaust the decoder's
  recursion is refused the same way (RecursionError never escapes).
  """
  try:
    value = json.loads(raw, parse_constant=_nonfinite, parse_float=_float, parse_int=_int)
  except RecursionError:
    raise ApiError(400, f"the request body is nested deeper than {MAX_DEPTH} levels "
                        f"(allowed at most {MAX_DEPTH})") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ApiError(400, f"the request body is not valid JSON ({e})") from None
  if isinstance(value, _Refused):
    raise _refuse((), value.why)
  # Walked with an explicit stack (no recursion); scalars are checked where they stand, so
  # paths are built only for containers and for the one value reported.
  stack = [(value, ())] if isinstance(value, (dict, list)) else []
  while stack:
    node, keys = stack.pop()
    if len(keys) >= MAX_DEPTH:
      raise ApiError(400, f"{_path(keys[:1])}: nested deeper than {MAX_DEPTH} levels "
                          f"(allowed at most {MAX_DEPTH})", _path(keys[:1]))
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, child in items:
      at = keys + (k,)
      if isinstance(k, str) and _SURROGATE.search(k):
        raise _refuse(keys, f"the key {k!r} holds a lone UTF-16 surrogate (not text)")
      if isinstance(child, (dict, list)):
        stack.append((child, at))
      elif isinstance(child, _Refused):
        raise _refuse(at, child.why)
      elif isinstance(child, str) and _SURROGATE.search(child):
        raise _refuse(at, "holds a lone UTF-16 surrogate escape (\\ud800-\\udfff): not "
                          "valid Unicode text")
  return value


def _allowed(name: str) -> str:
  lo, hi, integer, lo_open = _RANGES[name]
  return f"{'an integer' if integer else 'a number'} in {'(' if lo_open else '['}{lo}, {hi}]"


def _number(body: dict, name: str, default):
  """body[name] checked against _RANGES[name] (None or absent: `default`). Written as what
  must hold, so a NaN (which fails every comparison) could not pass either."""
  value = body.get(name)
  if value is None:
    return default
  lo, hi, integer, lo_open = _RANGES[name]
  ok = isinstance(value, int) if integer else isinstance(value, (int, float))
  if isinstance(value, bool) or not ok or not (lo <= value <= hi) or (lo_open and value == lo):
    raise _fail(name, f"{json.dumps(value)[:80]} is invalid: allowed {_allowed(name)}")
  return value


def _top_p(body: dict) -> float:
  top_p = float(_number(body, "top_p", 1.0))
  if np.float32(top_p) == 0:     # refused, as 0 would be: the sampler works in float32
    raise _fail("top_p", f"{top_p!r} is 0 in float32 (the sampler's precision): allowed "
                         f"{_allowed('top_p')}, at least 1e-45")
  return top_p


def _neutral(name: str, value: Any) -> bool:
  """Whether an unsupported option's value is its neutral one (type-strict: true is not 1)."""
  neutral = _NEUTRAL[name]
  if value is None or (name == "logprobs" and value is False):
    return True
  if isinstance(neutral, bool) or isinstance(value, bool):
    return value is neutral
  return neutral is not None and isinstance(value, (int, float)) and value == neutral


def _common(body: Any, *, default_max_tokens: int | None) -> tuple[str, Sampling]:
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise _fail("model", "required: the served model's id (see GET /v1/models)")
  for name, neutral in _NEUTRAL.items():
    if name in body and not _neutral(name, body[name]):
      raise _fail(name, f"{json.dumps(body[name])[:80]} is not supported by this server "
                        f"(allowed: {json.dumps(neutral)} or absent)")
  n = body.get("n")
  if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
    raise _fail("n", f"{json.dumps(n)[:80]} is not supported: allowed 1 (one choice per "
                     "prompt; send the request again for more samples)")
  stop = body.get("stop")
  if stop is None:
    stop = ()
  elif isinstance(stop, str):
    stop = (stop,)
  elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
    stop = tuple(stop)
  else:
    raise _fail("stop", "allowed a string or a list of at most 4 strings")
  if any(len(s) > MAX_STOP_CHARS for s in stop):
    raise _fail("stop", f"allowed strings of at most {MAX_STOP_CHARS} characters")
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise _fail("stream", f"{stream!r} is invalid: allowed true or false")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
    raise _fail("stream_options", "allowed {\"include_usage\": true|false}")
  key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else \
      "max_tokens"
  sampling = Sampling(
      max_tokens=_number(body, key, default_max_tokens),
      temperature=float(_number(body, "temperature", 1.0)),
      top_p=_top_p(body),
      top_k=int(_number(body, "top_k", 0)),
      seed=int(_number(body, "seed", 0)) % 2**32,
      stop=stop, stream=stream, include_usage=bool(options.get("include_usage", False)))
  return model, sampling


def _token_ids(value: list, param: str) -> tuple[int, ...]:
  for k, t in enumerate(value):
    if isinstance(t, bool) or not isinstance(t, int):
      raise _fail(f"{param}[{k}]", f"{json.dumps(t)[:40]} is not a token id: a list of "
                                   "token ids holds integers only")
  return tuple(value)


def parse_completion(body: Any) -> CompletionRequest:
  """A /v1/completions body -> CompletionRequest (max_tokens defaults to 16, as OpenAI's).
  `prompt`: a string, a list of token ids, or a list of at most MAX_PROMPTS of those (one
  choice each); token ids are integers here, checked against the vocabulary in app.py."""
  model, sampling = _common(body, default_max_tokens=16)
  prompt = body.get("prompt")
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not any(
      isinstance(p, (str, list)) for p in prompt)):
    prompts = [prompt]
  elif isinstance(prompt, list) and prompt:
    prompts = prompt
  else:
    raise _fail("prompt", "required: a non-empty string, a list of token ids, or a list of "
                          "those")
  if len(prompts) > MAX_PROMPTS:
    raise _fail("prompt", f"{len(prompts)} prompts: allowed at most {MAX_PROMPTS} in one "
                          "request")
  out = []
  for i, p in enumerate(prompts):
    param = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
    if isinstance(p, str) and p:
      out.append(p)
    elif isinstance(p, list) and p:
      out.append(_token_ids(p, param))
    else:
      raise _fail(param, f"{json.dumps(p)[:40]} is invalid: allowed a non-empty string or a "
                         "non-empty list of token ids (a list of token ids cannot mix with "
                         "strings)")
  return CompletionRequest(model, tuple(out), sampling)


def _content(message: dict, i: int, *, required: bool) -> str:
  """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
  content = message.get("content")
  if content is None and not required:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                       isinstance(p.get("text"), str) for p in content):
    return "".join(p["text"] for p in content)
  raise _fail(f"messages[{i}].content", "allowed a string or a list of text parts (this "
                                        "model reads text only)")


def tool_argument(arguments: Any, param: str) -> str:
  """The free-text argument of a tool call's `function.arguments` (see the module
  docstring)."""
  if not isinstance(arguments, str):
    raise _fail(param, "allowed a JSON string")
  try:
    value = json.loads(arguments) if arguments.strip() else {}
  except (ValueError, RecursionError):   # also an int over 4300 digits, deep nesting
    raise _fail(param, "is not valid JSON: expected {\"argument\": \"...\"}") from None
  if isinstance(value, dict) and set(value) <= {"argument"}:
    value = value.get("argument", "")
  if isinstance(value, str):
    if _SURROGATE.search(value):         # a "\\ud800" escape inside the arguments' JSON
      raise _fail(param, "holds a lone UTF-16 surrogate escape (\\ud800-\\udfff): not "
                         "valid Unicode text")
    return value
  raise _fail(param, "allowed {\"argument\": \"<text>\"}: this model's tools take one "
                     "free-text argument")


def tool_arguments(argument: str) -> str:
  """The wire form of a free-text tool argument."""
  return json.dumps({"argument": argument})


def _assistant(message: dict, i: int) -> Message:
  text = _content(message, i, required=False)
  calls = message.get("tool_calls") or []
  if not isinstance(calls, list) or len(calls) > 1:
    raise _fail(f"messages[{i}].tool_calls", "allowed at most one tool call per assistant "
                                             "turn (the chat format has one)")
  if not calls:
    return Message("assistant", "", Answer(text))
  fn = calls[0].get("function") if isinstance(calls[0], dict) else None
  if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
    raise _fail(f"messages[{i}].tool_calls[0].function", "needs a name and arguments")
  argument = tool_argument(fn.get("arguments", ""), f"messages[{i}].tool_calls[0].function."
                                                    "arguments")
  name = _tool_name(fn["name"], f"messages[{i}].tool_calls[0].function.name")
  return Message("assistant", text, ToolCall(name, argument))


def _tool_name(name: str, param: str) -> str:
  """`name`, checked by the chat format's own rule for a tool's name (an identifier)."""
  try:
    action_text(ToolCall(name, ""))
  except ValueError as e:
    raise _fail(param, str(e)) from None
  return name


def _tools(body: dict) -> tuple[ToolSpec, ...]:
  tools = body.get("tools") or []
  if not isinstance(tools, list):
    raise _fail("tools", "allowed a list of {\"type\": \"function\", \"function\": {...}}")
  out = []
  for i, t in enumerate(tools):
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      raise _fail(f"tools[{i}]", "allowed {\"type\": \"function\", \"function\": {\"name\": "
                                 "..., \"description\": ...}}")
    name = _tool_name(fn["name"], f"tools[{i}].function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
      raise _fail(f"tools[{i}].function.description", f"{json.dumps(description)[:40]} is "
                                                      "invalid: allowed a string")
    out.append(ToolSpec(name, description or ""))
  choice = body.get("tool_choice")
  if choice not in (None, "auto", "none"):
    raise _fail("tool_choice", f"{choice!r} is not supported: allowed \"auto\" or \"none\"")
  return tuple(out) if choice != "none" else ()


def parse_chat(body: Any) -> ChatRequest:
  """A /v1/chat/completions body -> ChatRequest (max_tokens defaults to the room left in
  the cache). Roles: system / developer (-> system), user, assistant (content and / or one
  tool call), tool (-> tool_result)."""
  model, sampling = _common(body, default_max_tokens=None)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise _fail("messages", "required: a non-empty list of {\"role\", \"content\"}")
  out = []
  for i, m in enumerate(messages):
    role = m.get("role") if isinstance(m, dict) else None
    if role == "assistant":
      out.append(_assistant(m, i))
    elif isinstance(role, str) and role in OPENAI_ROLES:   # (a JSON list is unhashable)
      out.append(Message(OPENAI_ROLES[role], _content(m, i, required=True)))
    else:
      raise _fail(f"messages[{i}].role", f"{role!r} is invalid: allowed system, developer, "
                                         "user, assistant, tool")
  return ChatRequest(model, tuple(out), _tools(body), sampling)
