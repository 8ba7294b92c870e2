"""The OpenAI server under hostile clients (issue 45): malformed bodies are 400 naming the
field (NaN, Infinity, deep nesting, huge integers, wrong types), oversized ones 413; a client
that goes away frees its slot at once; slow clients cannot hold connections or starve
/health; an API key, when set, is required everywhere but /health. Driven with the real
`openai` client and raw sockets on 127.0.0.1, against `fixtures.serve_in_thread` with the
same uvicorn settings as `python -m hybridmoe_jax.serve`."""

import asyncio
import http.client
import json
import os
import socket
import time
import urllib.parse

import pytest

pytest.importorskip("fastapi", reason="the `serve` extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the `serve` extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the `openai` client (test extra) is not installed")

from hybridmoe_jax import api  # noqa: E402
from hybridmoe_jax.serve.app import create_app  # noqa: E402
from hybridmoe_jax.serve.guard import HttpLimits, uvicorn_config  # noqa: E402
from hybridmoe_jax.serve.scheduler import Job, Scheduler  # noqa: E402
from tests.serve.fixtures import model_path  # noqa: E402,F401 (a fixture)
from tests.serve.fixtures import serve_in_thread  # noqa: E402

NAME = "tiny"
SLOTS = 2
LIMITS = HttpLimits(limit_concurrency=8, timeout_keep_alive=1, timeout_read=2)
MAX_BODY = 2**20
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def lm(model_path):
  # Rows of 1024 tokens: a request with max_tokens 1000 runs for seconds (the greedy
  # continuation of "hi" reaches EOS after 954 tokens), long after a disconnect is noticed.
  return api.load(model_path, max_len=1024, prefill_chunk=8, kv_block=16)


class Served:
  """A running server: its app, address and an `openai` client."""

  def __init__(self, app, url):
    self.app, self.url = app, url
    parts = urllib.parse.urlsplit(url)
    self.host, self.port = parts.hostname, parts.port
    self.client = openai.OpenAI(base_url=url, api_key="unused", max_retries=2, timeout=60)

  @property
  def scheduler(self):
    return self.app.state.server.scheduler

  def request(self, method, path, body=None, headers=None, timeout=30):
    """-> (status, parsed JSON body) over a fresh connection."""
    conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
    try:
      conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
      response = conn.getresponse()
      return response.status, json.loads(response.read() or b"null")
    finally:
      conn.close()

  def health(self, timeout=30):
    status, body = self.request("GET", "/health", timeout=timeout)
    assert status == 200
    return body

  def wait_idle(self, seconds):
    """-> seconds until /health shows no running or waiting job (fails after `seconds`)."""
    start = time.monotonic()
    while True:
      h = self.health()
      if h["running"] == 0 and h["waiting"] == 0:
        return time.monotonic() - start
      assert time.monotonic() - start < seconds, h
      time.sleep(0.02)


@pytest.fixture(scope="module")
def served(lm):
  app = create_app(lm, slots=SLOTS, model_name=NAME, max_body_bytes=MAX_BODY)
  with serve_in_thread(app, limits=LIMITS) as url:
    served = Served(app, url)
    # The scheduler compiles every shape before it serves: nothing is timed before that.
    served.scheduler.ready.wait(600)
    # One decode step per host round trip: a long request ("hi", 954 tokens) then runs for
    # seconds, long after a client is gone; at 16 steps per call it could end first.
    served.scheduler.decode_steps = 1
    served.client.completions.create(model=NAME, prompt="warm up", max_tokens=2)
    yield served


def _raw(served, payload: bytes, path="/v1/completions") -> socket.socket:
  """A raw POST of `payload` (sent whole), the socket left open."""
  sock = socket.create_connection((served.host, served.port))
  sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
  return sock


def _until_closed(sock, timeout) -> bytes | None:
  """All bytes the server sends until it closes the connection; None if still open after
  `timeout` seconds."""
  sock.settimeout(timeout)
  data = b""
  try:
    while chunk := sock.recv(65536):
      data += chunk
  except TimeoutError:
    return None
  except ConnectionResetError:
    pass
  return data


def _body(**fields) -> bytes:
  return json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2, **fields}).encode()


def _with(raw_field: str, value: str) -> bytes:
  """A completions body whose `raw_field` is the literal JSON text `value`."""
  return b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "%s": %s}' % (
      NAME.encode(), raw_field.encode(), value.encode())


BAD_BODIES = [
    # (body, param, words in the message)
    (_with("temperature", "NaN"), "temperature", "NaN is not allowed"),
    (_with("top_p", "NaN"), "top_p", "allowed a number in (0.0, 1.0]"),
    (_with("temperature", "Infinity"), "temperature", "Infinity is not allowed"),
    (_with("temperature", "-Infinity"), "temperature", "-Infinity is not allowed"),
    (_with("top_p", "1e999"), "top_p", "overflows to infinity"),
    (_with("top_p", "1e-320"), "top_p", "is 0 in float32"),
    (_with("stop", '["a", NaN]'), "stop[1]", "NaN"),
    (b"[" * 100_000 + b"]" * 100_000, None, "nested deeper than 64 levels"),
    (_with("prompt", "[" * 70 + "1" + "]" * 70), "prompt", "nested deeper than 64 levels"),
    (_with("prompt", "[1, 1e30]"), "prompt[1]", "not a token id"),
    (_with("prompt", "[1, %d]" % 2**63), "prompt[1]", "outside the vocabulary [0, 266)"),
    (_with("prompt", "[1, -1]"), "prompt[1]", "outside the vocabulary"),
    (_with("prompt", "[[1, 2], [3, 10000]]"), "prompt[1][1]", "outside the vocabulary"),
    (_with("prompt", "[1, %s]" % ("9" * 5000)), "prompt[1]", "5000 digits"),
    (_with("prompt", "[1, true]"), "prompt[1]", "not a token id"),
    (_with("prompt", '[1, "a"]'), "prompt[0]", "cannot mix with strings"),
    (_with("prompt", '[[1], [2, "3"]]'), "prompt[1][1]", "not a token id"),
    (_with("prompt", "[" + ", ".join(['"a"'] * 2049) + "]"), "prompt", "at most 2048"),
    (_with("prompt", '"a\\ud800b"'), "prompt", "surrogate"),
    (_with("max_tokens", "1" + "0" * 30), "max_tokens", "31 digits"),
    (_with("max_tokens", str(2**31)), "max_tokens", "allowed an integer in [1, 2147483647]"),
    (_with("max_tokens", "true"), "max_tokens", "allowed an integer"),
    (_with("max_tokens", '"5"'), "max_tokens", "allowed an integer"),
    (_with("max_tokens", "5.0"), "max_tokens", "allowed an integer"),
    (_with("n", "2"), "n", "allowed 1"),
    (_with("n", "true"), "n", "allowed 1"),
    (_with("n", "1.5"), "n", "allowed 1"),
    (_with("seed", str(2**64)), "seed", "allowed an integer in [-9223372036854775808"),
    (_with("seed", "1.5"), "seed", "allowed an integer"),
    (_with("top_k", "-1"), "top_k", "allowed an integer in [0, 2147483647]"),
    (_with("logprobs", "1" + "0" * 19), "logprobs", "not supported"),
    (_with("logprobs", "true"), "logprobs", "not supported"),
    (_with("echo", "1"), "echo", "not supported"),
    (_with("stop", json.dumps("x" * 1001)), "stop", "at most 1000 characters"),
    (_with("stream", "1"), "stream", "allowed true or false"),
    (b'"just a string"', None, "must be a JSON object"),
    (b"{not json", None, "not valid JSON"),
    (b"\xff\xfe\x00", None, "not valid JSON"),
]


def test_malformed_bodies_are_400_naming_the_field(served):
  for body, param, words in BAD_BODIES:
    status, reply = served.request("POST", "/v1/completions", body)
    error = reply["error"]
    assert status == 400 and error["param"] == param and words in error["message"], (
        body[:80], reply)
    assert error["type"] == "invalid_request_error"
  chat = [({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
          ({"messages": [{"role": "user", "content": "hi"}], "temperature": float("nan")},
           "temperature"),
          ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
           "messages[0].content"),
          ({"messages": [{"role": "assistant", "tool_calls": [
              {"type": "function", "function": {"name": "a b", "arguments": "{}"}}]}]},
           "messages[0].tool_calls[0].function.name")]
  for fields, param in chat:
    status, reply = served.request("POST", "/v1/chat/completions", json.dumps(
        {"model": NAME, **fields}).encode())
    assert status == 400 and reply["error"]["param"] == param, reply
  # The official client sends the same NaN (its JSON encoder allows it) or refuses it itself.
  try:
    served.client.completions.create(model=NAME, prompt="hi", temperature=float("nan"))
  except openai.BadRequestError as e:
    assert e.body["param"] == "temperature"
  except ValueError:
    pass
  else:
    pytest.fail("a NaN temperature was accepted")
  # Nothing above reached the scheduler, and the server still serves.
  assert served.health()["busy"] == 0
  assert served.client.completions.create(model=NAME, prompt=[1, 265], max_tokens=2).choices


def test_oversized_bodies_are_413(served):
  """Over max_body_bytes: refused by the declared length before the body is read, or counted
  as a chunked body arrives. Raw sockets: the server may close before all is sent."""
  head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
  chunk = b"x" * (MAX_BODY // 2)
  chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (chunk, chunk, b"y")) + b"0\r\n\r\n"
  for request in (head + b"Content-Length: 999999999\r\n\r\n{",
                  head + b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1) + b" " * MAX_BODY + b"{",
                  head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked):
    sock = socket.create_connection((served.host, served.port))
    try:
      sock.sendall(request)
    except (BrokenPipeError, ConnectionResetError):
      pass
    answer = _until_closed(sock, 10)
    sock.close()
    assert answer is not None and answer.startswith(b"HTTP/1.1 413"), answer
    assert b"larger than 1048576 bytes" in answer


def test_gone_clients_free_their_slots(served):
  """Clients that give up (raw sockets closed mid-request, streamed or not; the openai client
  timing out; an openai stream closed early) free their slots within a few decode steps,
  and a new request then runs at once."""
  sched = served.scheduler
  long = dict(prompt="hi", max_tokens=1000, temperature=0)
  cancelled = sched.stats["cancelled"]
  # Raw sockets: 2 whole requests hold both slots, a streamed one waits; all then vanish.
  socks = [_raw(served, _body(**long)) for _ in range(2)]
  socks.append(_raw(served, _body(stream=True, **long)))
  deadline = time.monotonic() + 30
  while (h := served.health())["running"] < SLOTS or h["busy"] < 3:
    assert time.monotonic() < deadline, h
    time.sleep(0.01)
  for s in socks:
    s.close()
  assert served.wait_idle(5) < 2
  assert sched.stats["cancelled"] - cancelled == 3       # cancelled, not finished
  # A streamed response the client stops reading after its first chunk.
  stream = served.client.completions.create(model=NAME, stream=True, **long)
  next(iter(stream))
  stream.close()
  assert served.wait_idle(5) < 2
  # The openai client giving up on a whole response (its read timeout).
  impatient = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=0.5)
  with pytest.raises(openai.APITimeoutError):
    impatient.completions.create(model=NAME, **long)
  assert served.wait_idle(5) < 2
  assert sched.stats["cancelled"] - cancelled == 5
  # The freed slots serve a new request at once.
  start = time.monotonic()
  got = served.client.completions.create(model=NAME, prompt="hello", max_tokens=5)
  assert got.usage.completion_tokens >= 1 and time.monotonic() - start < 10


def test_slow_clients_cannot_hold_connections_or_health(served):
  """Connections that send part of their headers or body, or nothing, hold at most
  limit_concurrency connections (the longest-waiting is closed with 503 for a new one), and
  are closed with 408 after timeout_read; /health answers within a second meanwhile."""
  partial = [b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Le",          # headers
             b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"",
             b""]                                                              # silent
  fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731  (server and client: this process)
  before = fds() if os.path.isdir("/proc/self/fd") else None
  socks = []
  for i in range(30):
    s = socket.create_connection((served.host, served.port))
    s.sendall(partial[i % 3])
    socks.append(s)
  time.sleep(0.2)
  if before is not None:
    # 30 client sockets here; the server keeps at most limit_concurrency of its ends.
    assert fds() - before - len(socks) <= LIMITS.limit_concurrency
  start = time.monotonic()
  assert served.health(timeout=1)["status"] == "ok"
  assert time.monotonic() - start < 1
  evicted = [_until_closed(s, 0.5) for s in socks[:30 - LIMITS.limit_concurrency]]
  assert all(a is not None and a.startswith(b"HTTP/1.1 503") for a in evicted), evicted
  # The rest are closed with 408 once timeout_read has passed since their first byte.
  rest = [_until_closed(s, LIMITS.timeout_read + 2) for s in socks[-5:]]
  assert all(a is not None and a.startswith(b"HTTP/1.1 408") for a in rest), rest
  assert b"timeout_read" in rest[0]
  for s in socks:
    s.close()
  # A keep-alive connection left idle is closed after timeout_keep_alive (silently); one
  # whose next request stalls gets 408 after timeout_read.
  idle, stalled = (socket.create_connection((served.host, served.port)) for _ in range(2))
  for sock in (idle, stalled):
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    sock.settimeout(5)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
  stalled.sendall(b"GET /health HTTP/1.1\r\nHo")
  start = time.monotonic()
  assert _until_closed(idle, LIMITS.timeout_keep_alive + 2) == b""
  answer = _until_closed(stalled, LIMITS.timeout_read + 2)
  assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start > LIMITS.timeout_read - 0.5
  idle.close()
  stalled.close()
  assert served.client.completions.create(model=NAME, prompt="hi", max_tokens=2).choices


def test_past_the_limit_with_every_connection_answering_is_503(served):
  long = _body(prompt="hi", max_tokens=1000, temperature=0)
  socks = [_raw(served, long) for _ in range(LIMITS.limit_concurrency)]
  deadline = time.monotonic() + 30
  while served.scheduler.busy < LIMITS.limit_concurrency:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  status, reply = served.request("GET", "/health", timeout=5)
  assert status == 503 and "all answering requests" in reply["error"]["message"]
  for s in socks:
    s.close()
  served.wait_idle(5)
  assert served.health()["status"] == "ok"


class _StuckTransport(asyncio.Transport):
  """A transport whose peer reads nothing (the kernel buffers are full); abort, as a real
  one, ends the connection (connection_lost)."""

  def __init__(self, protocol):
    super().__init__()
    self.protocol, self.aborted, self.closing = protocol, False, False

  def get_extra_info(self, name, default=None):
    return default

  def is_closing(self):
    return self.closing

  def abort(self):
    if not self.closing:
      self.aborted = self.closing = True
      asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)


def test_a_client_that_stops_reading_is_aborted_after_timeout_read():
  """Over loopback a whole response of the test model fits the kernel's buffers, so this
  drives the protocol by hand: a request is answered (an app that never finishes) and the
  transport pauses writing (its buffer is full)."""
  from uvicorn.server import ServerState

  async def answering(scope, receive, send):
    await asyncio.Event().wait()

  config = uvicorn_config(answering, HttpLimits(timeout_read=0.2), lifespan="off")
  config.load()

  async def run(resume: bool) -> bool:
    protocol = config.http_protocol_class(config=config, server_state=ServerState(),
                                          app_state={})
    transport = _StuckTransport(protocol)
    protocol.connection_made(transport)
    protocol.data_received(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
    protocol.pause_writing()
    if resume:
      await asyncio.sleep(0.1)
      protocol.resume_writing()
    await asyncio.sleep(0.4)
    aborted = transport.aborted
    transport.abort()            # the client leaves: the app's task can end
    await asyncio.sleep(0)
    return aborted

  assert asyncio.run(run(resume=False))
  assert not asyncio.run(run(resume=True))


def test_api_key_is_required_everywhere_but_health(lm):
  app = create_app(lm, slots=SLOTS, model_name=NAME, api_key=KEY)
  with serve_in_thread(app, limits=LIMITS) as url:
    served = Served(app, url)
    right = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    assert right.completions.create(model=NAME, prompt="hi", max_tokens=2).choices
    assert [m.id for m in right.models.list().data] == [NAME]
    wrong = openai.OpenAI(base_url=url, api_key=KEY + "x", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
      wrong.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
      wrong.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    for headers in ({}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY},
                    {"Authorization": "Bearer " + KEY[:-1]}):
      for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                           ("GET", "/docs")):
        status, reply = served.request(method, path, _body(), headers)
        assert status == 401 and reply["error"]["type"] == "invalid_request_error", (
            headers, path, reply)
    assert served.health()["status"] == "ok"          # no key needed
    assert served.request("GET", "/v1/models", headers={"Authorization": "bearer " + KEY}
                          )[0] == 200


def test_cancelled_jobs_leave_the_queue_and_their_slots_at_the_next_iteration(lm):
  # Driven by hand (no thread); the served fixture's options, so its compiled shapes.
  sched = Scheduler(lm.engine, slots=SLOTS, vocab_limit=lm.tokenizer.vocab_size)
  events = [[] for _ in range(4)]
  jobs = [Job(lm.tokenizer.encode("ab", bos=True), 100, events[i].append) for i in range(4)]
  for job in jobs:
    sched.submit(job)
  sched._iteration()
  assert (sched.running, sched.waiting) == (2, 2)
  sched.cancel(jobs[3])                  # waiting: leaves though no slot frees
  sched.cancel(jobs[0])                  # running: its slot goes to jobs[2]
  sched._iteration()
  assert (sched.running, sched.waiting) == (2, 0)
  assert events[3] == [("done", "cancelled")] and events[0][-1] == ("done", "cancelled")
  assert sched._rows[0] is jobs[2] and sched.stats["cancelled"] == 2
  # Both slots cancelled, nothing queued: the later slot is freed too (it was not while an
  # earlier slot was empty and the queue too).
  sched.cancel(jobs[2])
  sched.cancel(jobs[1])
  sched._iteration()
  assert (sched.running, sched.waiting) == (0, 0) and sched.stats["cancelled"] == 4


def test_the_command_line_reports_the_key_and_passes_the_limits(model_path, monkeypatch,
                                                                capsys):
  import uvicorn

  from hybridmoe_jax.serve.__main__ import _parser, main
  defaults = _parser().parse_args(["--workdir=x"])
  assert HttpLimits() == HttpLimits(defaults.limit_concurrency, defaults.timeout_keep_alive,
                                    defaults.timeout_read)
  seen = {}

  def run(server):
    seen["config"] = server.config
  monkeypatch.setattr(uvicorn.Server, "run", run)
  monkeypatch.delenv("HYBRIDMOE_API_KEY", raising=False)
  assert main([f"--workdir={model_path}", "--host=0.0.0.0", "--max_len=64",
               "--limit_concurrency=9", "--timeout_read=3.5", "--timeout_keep_alive=2"]) == 1
  err = capsys.readouterr().err
  assert "API key: none" in err and "warning: 0.0.0.0 is reachable from other machines" in err
  config = seen["config"]
  assert (config.timeout_keep_alive, config.host) == (2, "0.0.0.0")
  assert config.http.limits == HttpLimits(9, 2, 3.5)
  monkeypatch.setenv("HYBRIDMOE_API_KEY", KEY)
  main([f"--workdir={model_path}", "--host=0.0.0.0", "--max_len=64"])
  err = capsys.readouterr().err
  assert "API key: required" in err and "reachable" not in err and KEY not in err
  main([f"--workdir={model_path}", "--max_len=64", "--api-key="])       # flag wins: no key
  assert "API key: none" in capsys.readouterr().err
  assert main([f"--workdir={model_path}", "--limit_concurrency=1"]) == 2
  assert main([f"--workdir={model_path}", "--timeout_read=0"]) == 2
  err = capsys.readouterr().err
  assert "--limit_concurrency=1 is invalid" in err and "--timeout_read=0" in err
