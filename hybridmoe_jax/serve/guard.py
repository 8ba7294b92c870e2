"""What one HTTP client may hold of the server (connections, time), and who may call it.

`uvicorn_config(app, limits, ...)` is the one place the server's uvicorn settings are made
(`python -m hybridmoe_jax.serve` and the HTTP tests' server both use it). With `HttpLimits`:
  - at most `limit_concurrency` connections are open. A connection past the limit first
    closes (503) the longest-waiting one that is not being answered (idle keep-alive,
    headers or body still arriving); if every other one is being answered, it is itself
    answered 503 and closed at once. So the server's file descriptors stay bounded and
    /health keeps answering while slow clients hold connections;
  - a request's headers and body must arrive within `timeout_read` seconds of its first
    byte (a new connection's silence counts): otherwise 408 and the connection is closed.
    uvicorn itself (0.55) has no timeout for a request still arriving, so partial headers
    would hold a connection forever; `_GuardedH11` adds it. Likewise a client that stops
    reading a response: once the socket's buffers are full, it has `timeout_read` seconds
    to read again before the connection is aborted;
  - an idle connection between requests is closed after `timeout_keep_alive` (uvicorn's).
Headers: a header block still incomplete past 16 KiB is refused with 400 (h11's
max_incomplete_event_size, uvicorn's default); one that arrives whole in a single read (at
most the event loop's 256 KiB) is parsed. The body's size is bounded in app.py
(`max_body_bytes`, 413).

`ApiKeyGuard`: an ASGI middleware that answers 401 (OpenAI's error shape) to every request
but GET /health without `Authorization: Bearer <key>`; keys are compared in constant time.
"""

from __future__ import annotations

import dataclasses
import hmac
import http
import ipaddress
import json
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridmoe_jax.serve.protocol import ApiError

API_KEY_ENV = "HYBRIDMOE_API_KEY"


@dataclasses.dataclass(frozen=True)
class HttpLimits:
  """The server's connection limits (see the module docstring); all > 0."""
  limit_concurrency: int = 256
  timeout_keep_alive: float = 5.0
  timeout_read: float = 30.0

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{f.name}={value!r} is invalid: allowed a number > 0")
    if self.limit_concurrency != int(self.limit_concurrency) or self.limit_concurrency < 2:
      raise ValueError(f"limit_concurrency={self.limit_concurrency!r} is invalid: allowed "
                       "an integer >= 2")


def _raw_response(status: int, message: str) -> bytes:
  """A whole HTTP/1.1 response (OpenAI's error JSON) that closes the connection: for answers
  given outside any request cycle."""
  body = json.dumps(ApiError(status, message).body()).encode()
  head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
          f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
          "connection: close\r\n\r\n")
  return head.encode() + body


class _GuardedH11(H11Protocol):
  """uvicorn's h11 protocol with a request read timeout and a connection cap (`limits` is
  set on the subclass `uvicorn_config` makes)."""
  limits: HttpLimits

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._read_timer = None
    self._write_timer = None
    self._waiting_since = time.monotonic()

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    self._make_room()
    self._watch()

  def data_received(self, data: bytes) -> None:
    super().data_received(data)
    self._watch()

  def on_response_complete(self) -> None:
    super().on_response_complete()
    self._waiting_since = time.monotonic()
    self._watch()

  def connection_lost(self, exc) -> None:
    self._stop_timer()
    if self._write_timer is not None:
      self._write_timer.cancel()
    super().connection_lost(exc)

  # ---- the write timeout -----------------------------------------------------------------
  def pause_writing(self) -> None:
    # The client reads nothing while the response waits to be sent: abort (not close, which
    # would wait to flush) if that lasts timeout_read; the response's task then sees a
    # disconnect and its jobs are cancelled.
    super().pause_writing()
    if self._write_timer is None:
      self._write_timer = self.loop.call_later(self.limits.timeout_read, self.transport.abort)

  def resume_writing(self) -> None:
    super().resume_writing()
    if self._write_timer is not None:
      self._write_timer.cancel()
      self._write_timer = None

  # ---- the read timeout ------------------------------------------------------------------
  def _reading(self) -> bool:
    """A request is arriving: its headers or body are not all here, and uvicorn is not
    timing the connection as idle keep-alive."""
    return (self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
            and self.timeout_keep_alive_task is None and not self.transport.is_closing())

  def _watch(self) -> None:
    # Armed once per request, never pushed back by more bytes: a client sending one byte a
    # second still has timeout_read in all.
    if not self._reading():
      self._stop_timer()
    elif self._read_timer is None:
      self._read_timer = self.loop.call_later(self.limits.timeout_read, self._read_timeout)

  def _stop_timer(self) -> None:
    if self._read_timer is not None:
      self._read_timer.cancel()
      self._read_timer = None

  def _read_timeout(self) -> None:
    self._read_timer = None
    if self._reading():
      self._drop(408, f"the request did not arrive within {self.limits.timeout_read:g} s "
                      "of its first byte (--timeout_read); the connection is closed")

  # ---- the connection cap ----------------------------------------------------------------
  def _evictable(self) -> bool:
    """Nothing is being answered here: idle, or a request still arriving."""
    if self.transport.is_closing():
      return False
    return (self.cycle is None or self.cycle.response_complete
            or self.conn.their_state is h11.SEND_BODY)

  def _make_room(self) -> None:
    cap = self.limits.limit_concurrency
    live = [c for c in self.connections if not c.transport.is_closing()]
    excess = len(live) - cap
    if excess <= 0:
      return
    idle = sorted((c for c in live if c is not self and isinstance(c, _GuardedH11)
                   and c._evictable()), key=lambda c: c._waiting_since)[:excess]
    for c in idle:
      c._drop(503, f"the server is at its limit of {cap} connections (--limit_concurrency)"
                   " and this connection was the longest waiting")
    if len(idle) < excess:
      self._drop(503, f"the server is at its limit of {cap} connections "
                      "(--limit_concurrency), all answering requests; retry later")

  def _drop(self, status: int, message: str) -> None:
    """Close the connection; where a request is arriving or may arrive (not idle keep-alive,
    no response started) first answer `status` with `message`."""
    if self.transport.is_closing():
      return
    answered = self.cycle is not None and self.cycle.response_started and \
        not self.cycle.response_complete
    if self.timeout_keep_alive_task is None and not answered:
      self.transport.write(_raw_response(status, message))
    self.transport.close()


def uvicorn_config(app, limits: HttpLimits, **kwargs) -> uvicorn.Config:
  """The uvicorn.Config serving `app` under `limits` (kwargs: host, port, log_level, ...).
  uvicorn's own limit_concurrency is left unset: it counts connections still closing and
  requests still finishing, so right after slow connections are closed for a new one it
  would answer that one's request 503; the cap is kept at connect time instead."""
  protocol = type("GuardedH11Protocol", (_GuardedH11,), {"limits": limits})
  kwargs.setdefault("log_level", "warning")
  return uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.timeout_keep_alive,
                        **kwargs)


class ApiKeyGuard:
  """ASGI middleware: every request but GET /health must carry `Authorization: Bearer
  <api_key>` (compared with hmac.compare_digest), else 401 with OpenAI's error object."""

  def __init__(self, app, api_key: str):
    if not api_key:
      raise ValueError("api_key must be a non-empty string")
    self.app, self.key = app, api_key.encode()

  def _authorized(self, scope) -> bool:
    given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    scheme, _, token = given.partition(b" ")
    # compare_digest runs in time independent of where the bytes differ (it may reveal the
    # length, never the key).
    return hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and scope["path"] != "/health" and not self._authorized(scope):
      body = json.dumps(ApiError(401, "a valid API key is required: send `Authorization: "
                                      "Bearer <key>` (the server's --api-key)", None,
                                 "invalid_api_key").body()).encode()
      await send({"type": "http.response.start", "status": 401, "headers": [
          (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
          (b"www-authenticate", b"Bearer")]})
      await send({"type": "http.response.body", "body": body})
      return
    await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
  """Whether `host` (a --host value) listens on this machine only."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False        # a name: it may resolve to any interface
