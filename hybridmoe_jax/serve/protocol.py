"""OpenAI request bodies -> checked dataclasses; responses and errors in OpenAI's shapes.

Only JSON-level checks live here (types, ranges, unsupported options); what needs the model
(prompt length against the cache, the tokenizer's chat roles) is checked in app.py. Every
bad field raises `ApiError(status, message, param)`, rendered as OpenAI's error object
{"error": {"message", "type", "param", "code"}}.

Tool calls: our chat format (rl/chat_format.py) gives a tool ONE free-text argument
("<tool_call> name argument <end_turn>"). On the wire it is
`function.arguments = json.dumps({"argument": text})`; a request's assistant tool call may
send that object or a bare JSON string.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hybridmoe_jax.rl.chat_format import Message
from hybridmoe_jax.rl.envs.base import Answer, ToolCall, ToolSpec

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


def _number(body: dict, name: str, default, lo: float, hi: float, *, integer: bool = False,
            lo_open: bool = False):
  value = body.get(name)
  if value is None:
    return default
  ok = isinstance(value, int) if integer else isinstance(value, (int, float))
  if isinstance(value, bool) or not ok or value < lo or value > hi or (lo_open and value == lo):
    kind = "an integer" if integer else "a number"
    low = f"({lo}" if lo_open else f"[{lo}"
    raise _fail(name, f"{value!r} is invalid: allowed {kind} in {low}, {hi}]")
  return value


def _common(body: Any, *, default_max_tokens: int | None) -> tuple[str, Sampling]:
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise _fail("model", "required: the served model's id (see GET /v1/models)")
  for name, neutral in _NEUTRAL.items():
    if name in body and body[name] not in (neutral, None) and not (
        name == "logprobs" and body[name] is False):
      raise _fail(name, f"{body[name]!r} is not supported by this server (allowed: "
                        f"{neutral!r} or absent)")
  if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
    raise _fail("n", f"{body['n']!r} is not supported: allowed 1 (one choice per prompt; "
                     "send the request again for more samples)")
  stop = body.get("stop")
  if stop is None:
    stop = ()
  elif isinstance(stop, str):
    stop = (stop,)
  elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
    stop = tuple(stop)
  else:
    raise _fail("stop", "allowed a string or a list of at most 4 strings")
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise _fail("stream", f"{stream!r} is invalid: allowed true or false")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
    raise _fail("stream_options", "allowed {\"include_usage\": true|false}")
  max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
  key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
  max_tokens = _number({key: max_tokens}, key, default_max_tokens, 1, 2**31 - 1,
                       integer=True)
  sampling = Sampling(
      max_tokens=max_tokens,
      temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
      top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
      top_k=int(_number(body, "top_k", 0, 0, 2**31 - 1, integer=True)),
      seed=int(_number(body, "seed", 0, -2**63, 2**64 - 1, integer=True)) % 2**32,
      stop=stop, stream=stream, include_usage=bool(options.get("include_usage", False)))
  return model, sampling


def parse_completion(body: Any) -> CompletionRequest:
  """A /v1/completions body -> CompletionRequest (max_tokens defaults to 16, as OpenAI's)."""
  model, sampling = _common(body, default_max_tokens=16)
  prompt = body.get("prompt")
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and
                                 all(isinstance(t, int) for t in prompt)):
    prompts = [prompt]
  elif isinstance(prompt, list) and prompt:
    prompts = prompt
  else:
    raise _fail("prompt", "required: a non-empty string, a list of token ids, or a list of "
                          "those")
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str) and p:
      out.append(p)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in p):
      out.append(tuple(p))
    else:
      raise _fail(f"prompt[{i}]" if len(prompts) > 1 else "prompt",
                  "allowed a non-empty string or a non-empty list of token ids")
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
  except json.JSONDecodeError:
    raise _fail(param, "is not valid JSON: expected {\"argument\": \"...\"}") from None
  if isinstance(value, str):
    return value
  if isinstance(value, dict) and set(value) <= {"argument"} and isinstance(
      value.get("argument", ""), str):
    return value.get("argument", "")
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
  try:
    return Message("assistant", text, ToolCall(fn["name"], argument))
  except ValueError as e:
    raise _fail(f"messages[{i}].tool_calls[0].function.name", str(e)) from None


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
    out.append(ToolSpec(fn["name"], str(fn.get("description", ""))))
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
    if role in ("system", "developer"):
      out.append(Message("system", _content(m, i, required=True)))
    elif role == "user":
      out.append(Message("user", _content(m, i, required=True)))
    elif role == "assistant":
      out.append(_assistant(m, i))
    elif role == "tool":
      out.append(Message("tool_result", _content(m, i, required=True)))
    else:
      raise _fail(f"messages[{i}].role", f"{role!r} is invalid: allowed system, developer, "
                                         "user, assistant, tool")
  return ChatRequest(model, tuple(out), _tools(body), sampling)
