"""The HTTP side of one request, apart from its routes: the body read under a byte limit,
server-sent events that cancel their jobs however they end, and a whole reply raced against
the client's disconnect (so a gone client's scheduler slot frees at once)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from hybridmoe_jax.serve.protocol import ApiError, load_json


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
  """Server-sent events in OpenAI's form: `data: {json}` per chunk, then `data: [DONE]`."""
  try:
    async for chunk in chunks:
      yield f"data: {json.dumps(chunk)}\n\n"
  except ApiError as e:
    yield f"data: {json.dumps(e.body())}\n\n"
  yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
  """An SSE response that calls `on_close` however it ends. Starlette cancels the sending
  task when the client disconnects, which may leave the chunk generators suspended (not
  closed) if it was waiting to send; `on_close` cancels the jobs without waiting for them
  to be collected."""

  def __init__(self, chunks: AsyncIterator[dict], on_close):
    super().__init__(sse(chunks), media_type="text/event-stream")
    self.on_close = on_close

  async def __call__(self, scope, receive, send):
    try:
      await super().__call__(scope, receive, send)
    finally:
      self.on_close()


async def disconnected(receive) -> None:
  """Returns when the client is gone. Called once the body is read: the ASGI receive channel
  then has nothing but http.disconnect to give (uvicorn also gives it when the response is
  complete, which ends this too)."""
  while (await receive())["type"] != "http.disconnect":
    pass


async def while_connected(request: Request, reply) -> dict | None:
  """`reply`: an app.Reply. -> reply.whole's dict, or None when the client disconnects first (then the work and its
  jobs are cancelled at once: the slot frees at the scheduler's next iteration)."""
  work = asyncio.ensure_future(reply.whole)
  gone = asyncio.ensure_future(disconnected(request.receive))
  try:
    await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
  finally:
    gone.cancel()
    finished = work.done()
    if not finished:
      work.cancel()
      reply.cancel()
  return work.result() if finished else None


async def read_body(request: Request, max_bytes: int) -> Any:
  """The request's JSON value (protocol.load_json), read up to `max_bytes` (413 beyond)."""
  too_big = ApiError(413, f"the request body is larger than {max_bytes} bytes (the server's "
                          "--max_body_bytes)")
  declared = request.headers.get("content-length", "")
  if declared.isascii() and declared.isdigit() and (len(declared) > 18 or
                                                    int(declared) > max_bytes):
    raise too_big
  chunks, size = [], 0
  try:
    async for chunk in request.stream():
      size += len(chunk)
      if size > max_bytes:
        raise too_big
      chunks.append(chunk)
  except ClientDisconnect:
    raise ApiError(400, "the client disconnected before sending the whole body") from None
  return load_json(b"".join(chunks))
