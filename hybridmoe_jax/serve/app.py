"""The OpenAI-compatible HTTP routes: /v1/models, /v1/completions, /v1/chat/completions.

`create_app(model, slots=S)` -> a FastAPI app over a `LoadedModel` (hybridmoe_jax.api.load)
whose requests all run on one continuous-batching `Scheduler` (S cache rows; scheduler.py).
Each prompt is one scheduler Job; its token events (a few ids per scheduler call) reach the
request's coroutine through an asyncio queue and `infer.streaming.TextStream` turns them into
text as `LoadedModel.generate` does, so a streamed response (one chunk per event), a
non-streamed one and `generate` give the same text.

Operations: the scheduler compiles every shape before it serves (warm-up; /health answers
503 {"status": "warming_up", "compiled": i, "of": n} until then, 200 after; requests sent
meanwhile wait); GET /metrics is Prometheus' text format (metrics.py); each request logs one
line (logger "hybridmoe_jax.serve"); at shutdown running requests get `shutdown_drain`
seconds to finish, then are cancelled.

Completions: text prompts are encoded with BOS first; token-id lists are used as given; a
list of prompts gives one choice each. Generation ends at EOS (not shown), a stop string
(cut before it) or max_tokens (default 16). Chat: the messages are rendered with the RL chat
format (the tokenizer needs the chat roles) and end at <end_turn>. A turn ending in a tool
call ("<tool_call> name argument") comes back as `tool_calls` with finish_reason
"tool_calls" (protocol.py: the argument's JSON form); free text and an <answer> as
`content`. Request `tools` are listed in the system turn (chat_format.system_prompt).

Refused with 4xx before any compute, in OpenAI's error shape: malformed fields, n > 1,
unsupported options (logprobs, penalties, ...), an unknown model id (404), token ids outside
the vocabulary, and a prompt whose tokens + max_tokens exceed the cache row (max_len): never
truncated silently. Bodies: at most `max_body_bytes` (413), then `protocol.load_json` (no
NaN / Infinity, no huge integers, no deep nesting, no lone surrogates: 400 naming the field).

A request's scheduler jobs live only as long as its client: a streamed response cancels
them when it ends for any reason (client gone included), a whole one when the client
disconnects while it is generated (the ASGI receive channel's http.disconnect), so a gone
client's slot is free after the scheduler's next iteration. With `api_key`, every route but
/health needs `Authorization: Bearer <key>` (guard.ApiKeyGuard). HTTP-level limits
(connections, read timeouts) are uvicorn's settings: guard.uvicorn_config.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import time
from typing import Any, AsyncIterator, Coroutine

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from hybridmoe_jax.data.tokenizers.base import TokenizerError
from hybridmoe_jax.infer.streaming import TextStream
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.chat_format import Message
from hybridmoe_jax.rl.envs.base import ToolCall
from hybridmoe_jax.serve.guard import ApiKeyGuard
from hybridmoe_jax.serve.metrics import CONTENT_TYPE as METRICS_TYPE
from hybridmoe_jax.serve.protocol import (MAX_BODY_BYTES, ApiError, Sampling,
                                          parse_chat, parse_completion, tool_arguments)
from hybridmoe_jax.serve.scheduler import Job, Scheduler
from hybridmoe_jax.serve.transport import EventStream, read_body, while_connected

_ids = itertools.count()


def _response_id(prefix: str) -> str:
  return f"{prefix}-{int(time.time())}-{next(_ids)}"


class _TextChoice:
  """One choice of a completion: token events -> text pieces and a finish reason."""

  def __init__(self, tokenizer, stop: tuple[str, ...], stop_ids: frozenset):
    self.text = TextStream(tokenizer, stop)
    self.stop_ids = stop_ids
    self.finish: str | None = None
    self.tokens = 0

  def shown(self, token: int) -> bool:
    """Record a drawn token -> whether its text belongs to the visible output."""
    return token not in self.stop_ids

  def on_tokens(self, tokens) -> str:
    """The text of a run of drawn tokens."""
    return "".join(self.on_token(t) for t in tokens)

  def on_token(self, token: int) -> str:
    if self.finish is not None:
      return ""                      # drawn after a stop string, before the cancel landed
    self.tokens += 1
    if not self.shown(token):
      return ""
    piece = self.text.push(token)
    if self.text.stopped:
      self.finish = "stop"
    return piece

  def on_done(self, reason: str) -> str:
    tail = self.text.finish()
    if self.finish is None:
      self.finish = "length" if reason == "length" else "stop"
    return tail


class _ChatChoice(_TextChoice):
  """A chat turn: text before a <tool_call> (special ids dropped) is content; a turn ending
  in a well-formed tool call becomes `tool_call` (name, argument)."""

  def __init__(self, tokenizer, stop, stop_ids):
    super().__init__(tokenizer, stop, stop_ids)
    self.tokenizer = tokenizer
    self.roles = chat_format.chat_ids(tokenizer)
    self.special = frozenset(tokenizer.special_ids.values())
    self.ids: list[int] = []
    self.in_tool_call = False
    self.tool_call: ToolCall | None = None

  def shown(self, token: int) -> bool:
    self.ids.append(token)
    self.in_tool_call |= token == self.roles["tool_call"]
    return not self.in_tool_call and token not in self.special

  def on_done(self, reason: str) -> str:
    tail = super().on_done(reason)
    if self.in_tool_call and self.finish == "stop" and reason == "stop":
      action = chat_format.parse_assistant(self.tokenizer, self.ids)
      if isinstance(action, ToolCall):
        self.tool_call, self.finish = action, "tool_calls"
    return tail


@dataclasses.dataclass
class _Prepared:
  """A checked request: prompts as ids and one choice object per prompt."""
  ids: list[np.ndarray]
  choices: list[_TextChoice]
  sampling: Sampling
  max_tokens: list[int]
  stop_ids: frozenset
  jobs: list[Job] = dataclasses.field(default_factory=list)   # submitted so far


@dataclasses.dataclass
class Reply:
  """A request's answer, not yet produced: `whole` (a coroutine -> the JSON dict) or
  `stream` (chunks); `cancel()` ends its scheduler jobs (harmless once they are done)."""
  prep: _Prepared
  scheduler: Scheduler
  whole: Coroutine[Any, Any, dict] | None = None
  stream: AsyncIterator[dict] | None = None

  def cancel(self) -> None:
    for job in self.prep.jobs:
      self.scheduler.cancel(job)


class Server:
  """The routes' state: the model, its tokenizer, the scheduler and the served id.
  `scheduler` holds the Scheduler's keyword arguments (decode_steps, prefill_rows,
  prefix_cache_bytes, progress)."""

  def __init__(self, model, *, slots: int = 8, model_name: str | None = None,
               scheduler: dict | None = None):
    self.lm, self.tokenizer = model, model.tokenizer
    self.name = model_name or str(model.info.get("path", "hybridmoe_jax")).rstrip("/").split(
        "/")[-1]
    self.scheduler = Scheduler(model.engine, slots=slots,
                               vocab_limit=int(self.tokenizer.vocab_size), **(scheduler or {}))
    self.created = int(time.time())

  # ---- checks --------------------------------------------------------------------------------
  def _check_model(self, name: str) -> None:
    if name != self.name:
      raise ApiError(404, f"model: {name!r} is not served here; this server serves "
                          f"{self.name!r} (GET /v1/models)", "model", "model_not_found")

  def _fit(self, ids: np.ndarray, max_tokens: int | None, param: str) -> int:
    """-> max_tokens (None: the room left), after checking prompt + max_tokens <= max_len."""
    cap, n = self.lm.max_len, len(ids)
    if max_tokens is None and n >= cap:
      raise ApiError(400, f"{param}: {n} prompt tokens leave no room to generate in this "
                          f"model's context of {cap} tokens (the cache row); shorten the "
                          "prompt (nothing is truncated)", param, "context_length_exceeded")
    if max_tokens is None:
      max_tokens = cap - n
    if n + max_tokens > cap:
      raise ApiError(400, f"{param}: {n} prompt tokens + max_tokens {max_tokens} exceed this "
                          f"model's context of {cap} tokens (the cache row); shorten the "
                          f"prompt or lower max_tokens (nothing is truncated)", param,
                     "context_length_exceeded")
    return max_tokens

  def _prepare_completion(self, body) -> _Prepared:
    req = parse_completion(body)
    self._check_model(req.model)
    vocab = self.lm.config.vocab_size
    ids, limits = [], []
    for i, p in enumerate(req.prompts):
      param = f"prompt[{i}]" if len(req.prompts) > 1 else "prompt"
      if isinstance(p, str):
        row = np.asarray(self.tokenizer.encode(p, bos=True), np.int32)
      else:
        # Checked as Python ints: a 2**63 would overflow numpy before any range check.
        bad = next((k for k, t in enumerate(p) if not 0 <= t < vocab), None)
        if bad is not None:
          raise ApiError(400, f"{param}[{bad}]: token id {p[bad]} is outside the vocabulary "
                              f"[0, {vocab})", f"{param}[{bad}]")
        row = np.asarray(p, np.int32)
      limits.append(self._fit(row, req.sampling.max_tokens, param))
      ids.append(row)
    stop_ids = frozenset({int(self.tokenizer.eos_id)})
    choices = [_TextChoice(self.tokenizer, req.sampling.stop, stop_ids) for _ in ids]
    return _Prepared(ids, choices, req.sampling, limits, stop_ids)

  def _prepare_chat(self, body) -> _Prepared:
    req = parse_chat(body)
    self._check_model(req.model)
    try:
      roles = chat_format.chat_ids(self.tokenizer)
    except TokenizerError as e:
      raise ApiError(400, f"this model cannot chat: {e}; use /v1/completions") from None
    messages = list(req.messages)
    if req.tools:
      tools = chat_format.system_prompt(req.tools)
      if messages[0].role == "system":
        messages[0] = Message("system", tools + "\n" + messages[0].text)
      else:
        messages.insert(0, Message("system", tools))
    ids = chat_format.render(self.tokenizer, messages, add_generation_prompt=True).ids
    limit = self._fit(ids, req.sampling.max_tokens, "messages")
    stop_ids = frozenset({roles["end_turn"], int(self.tokenizer.eos_id)})
    return _Prepared([ids], [_ChatChoice(self.tokenizer, req.sampling.stop, stop_ids)],
                     req.sampling, [limit], stop_ids)

  # ---- running -------------------------------------------------------------------------------
  async def _events(self, prep: _Prepared, rid: str) -> AsyncIterator[tuple[int, str, Any]]:
    """Submit one Job per prompt; yield (choice index, kind, value) as they come. A choice
    that saw a stop string is cancelled; leaving early cancels all (client gone)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def emit(i, event):
      try:
        loop.call_soon_threadsafe(queue.put_nowait, (i, *event))
      except RuntimeError:     # the event loop has closed (shutdown): nobody is listening
        pass

    s = prep.sampling
    jobs = [Job(ids, limit, functools.partial(emit, i), temperature=s.temperature,
                top_k=s.top_k, top_p=s.top_p, seed=s.seed, stop_tokens=prep.stop_ids,
                name=rid if len(prep.ids) == 1 else f"{rid}/{i}")
            for i, (ids, limit) in enumerate(zip(prep.ids, prep.max_tokens))]
    try:
      for job in jobs:
        prep.jobs.append(job)
        try:
          self.scheduler.submit(job)
        except RuntimeError as e:      # shutting down
          raise ApiError(503, f"the server is shutting down ({e}); retry elsewhere") from None
      left = len(jobs)
      while left:
        i, kind, value = await queue.get()
        if kind != "tokens":
          left -= 1
          if kind == "error":
            raise ApiError(500, f"generation failed: {value}")
        yield i, kind, value
        if prep.choices[i].finish is not None and kind == "tokens":
          self.scheduler.cancel(jobs[i], "stop")     # counted as a stop, not a gone client
    finally:
      for job in jobs:
        self.scheduler.cancel(job)

  def _usage(self, prep: _Prepared) -> dict[str, int]:
    prompt = sum(len(i) for i in prep.ids)
    completion = sum(c.tokens for c in prep.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}

  async def _pieces(self, prep: _Prepared, rid: str) -> AsyncIterator[tuple[int, str, bool]]:
    """(choice index, text piece, whether the choice just finished)."""
    async for i, kind, value in self._events(prep, rid):
      choice = prep.choices[i]
      if kind == "tokens":
        was_done = choice.finish is not None
        piece = choice.on_tokens(value)
        if piece or (choice.finish is not None and not was_done):
          yield i, piece, False
      else:
        yield i, choice.on_done(value), True

  # ---- responses -----------------------------------------------------------------------------
  def completion(self, body) -> Reply:
    """A /v1/completions body -> its Reply (ApiError: refused before any job exists)."""
    prep = self._prepare_completion(body)
    rid, head = _response_id("cmpl"), {"object": "text_completion", "created": int(time.time()),
                                       "model": self.name}
    if prep.sampling.stream:
      return Reply(prep, self.scheduler, stream=self._completion_chunks(prep, rid, head))
    return Reply(prep, self.scheduler, whole=self._completion_whole(prep, rid, head))

  async def _completion_whole(self, prep, rid, head) -> dict:
    texts = [""] * len(prep.ids)
    async for i, piece, _ in self._pieces(prep, rid):
      texts[i] += piece
    choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": c.finish}
               for i, (t, c) in enumerate(zip(texts, prep.choices))]
    return {"id": rid, **head, "choices": choices, "usage": self._usage(prep)}

  async def _completion_chunks(self, prep, rid, head) -> AsyncIterator[dict]:
    async for i, piece, done in self._pieces(prep, rid):
      finish = prep.choices[i].finish if done else None
      if piece or done:
        yield {"id": rid, **head, "choices": [{"index": i, "text": piece, "logprobs": None,
                                                "finish_reason": finish}]}
    if prep.sampling.include_usage:
      yield {"id": rid, **head, "choices": [], "usage": self._usage(prep)}

  def chat(self, body) -> Reply:
    """A /v1/chat/completions body -> its Reply (ApiError: refused before any job exists)."""
    prep = self._prepare_chat(body)
    rid, head = _response_id("chatcmpl"), {"object": "chat.completion",
                                           "created": int(time.time()), "model": self.name}
    if prep.sampling.stream:
      chunk_head = dict(head, object="chat.completion.chunk")
      return Reply(prep, self.scheduler, stream=self._chat_chunks(prep, rid, chunk_head))
    return Reply(prep, self.scheduler, whole=self._chat_whole(prep, rid, head))

  async def _chat_whole(self, prep, rid, head) -> dict:
    content = ""
    async for _, piece, _ in self._pieces(prep, rid):
      content += piece
    choice = prep.choices[0]
    message = {"role": "assistant", "content": content or None}
    if choice.tool_call is not None:
      message["tool_calls"] = [_tool_call_json(choice.tool_call, rid)]
    else:
      message["content"] = content
    return {"id": rid, **head, "usage": self._usage(prep), "choices": [
        {"index": 0, "message": message, "finish_reason": choice.finish, "logprobs": None}]}

  async def _chat_chunks(self, prep, rid, head) -> AsyncIterator[dict]:
    chunk = lambda delta, finish=None: {"id": rid, **head, "choices": [  # noqa: E731
        {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    yield chunk({"role": "assistant", "content": ""})
    async for _, piece, done in self._pieces(prep, rid):
      if piece:
        yield chunk({"content": piece})
      if done:
        choice = prep.choices[0]
        if choice.tool_call is not None:
          call = dict(_tool_call_json(choice.tool_call, rid), index=0)
          yield chunk({"tool_calls": [call]})
        yield chunk({}, choice.finish)
    if prep.sampling.include_usage:
      yield {"id": rid, **head, "choices": [], "usage": self._usage(prep)}

  def models(self) -> dict:
    return {"object": "list", "data": [{"id": self.name, "object": "model",
                                        "created": self.created, "owned_by": "hybridmoe_jax",
                                        "max_model_len": self.lm.max_len}]}


def _tool_call_json(call: ToolCall, rid: str) -> dict:
  return {"id": f"call-{rid}", "type": "function",
          "function": {"name": call.name, "arguments": tool_arguments(call.argument)}}


def create_app(model, *, slots: int = 8, model_name: str | None = None,
               api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               shutdown_drain: float = 0.0, **scheduler) -> FastAPI:
  """The FastAPI app serving `model` (a LoadedModel) with `slots` cache rows; its scheduler
  thread (warm-up first) runs while the app does (lifespan). `api_key` (None or ""): no key
  needed; else every route but /health needs `Authorization: Bearer <api_key>`. Bodies over
  `max_body_bytes` are refused (413). At shutdown the running requests get `shutdown_drain`
  seconds to finish before they are cancelled. `scheduler`: the Scheduler's options
  (decode_steps, prefill_rows, prefix_cache_bytes, progress)."""
  server = Server(model, slots=slots, model_name=model_name, scheduler=scheduler)

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    server.scheduler.start()
    try:
      yield
    finally:
      # In a worker thread: draining waits, and the event loop must keep streaming.
      await asyncio.to_thread(server.scheduler.stop, drain=shutdown_drain)

  app = FastAPI(title="hybridmoe_jax", lifespan=lifespan)
  app.state.server = server
  if api_key:
    app.add_middleware(ApiKeyGuard, api_key=api_key)

  @app.exception_handler(ApiError)
  async def _api_error(_request, e: ApiError):
    # 413: the rest of the body is never read, so the connection cannot be reused.
    headers = {"connection": "close"} if e.status == 413 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)

  @app.exception_handler(HTTPException)
  async def _http_error(_request, e: HTTPException):
    return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

  async def respond(request: Request, make) -> Response:
    reply = make(await read_body(request, max_body_bytes))
    if reply.stream is not None:
      return EventStream(reply.stream, reply.cancel)
    result = await while_connected(request, reply)
    # 499 (nginx's "client closed request"): nobody reads it, the access log shows it.
    return JSONResponse(result) if result is not None else Response(status_code=499)

  @app.get("/v1/models")
  async def models():
    return server.models()

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await respond(request, server.completion)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    return await respond(request, server.chat)

  @app.get("/health")
  async def health():
    sched = server.scheduler
    state = {"slots": sched.slots, "running": sched.running, "waiting": sched.waiting,
             "busy": sched.busy, "compiled": sched.compiled[0], "of": sched.compiled[1]}
    if not sched.ready.is_set():
      return JSONResponse({"status": "warming_up", **state}, status_code=503)
    return {"status": "ok", **state}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(server.scheduler.render_metrics(), media_type=METRICS_TYPE)

  return app
