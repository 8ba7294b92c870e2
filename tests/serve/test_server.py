"""The OpenAI-compatible server, driven by the official `openai` client against uvicorn on
127.0.0.1: outputs equal `generate`'s token for token (greedy and seeded sampling, alone and
concurrent), streaming equals non-streaming, 4xx errors in OpenAI's shape; the scheduler's
interleaving of prefill chunks with decode steps; tool calls through the chat format."""

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the `serve` extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the `serve` extra (uvicorn) is not installed")
openai = pytest.importorskip("openai", reason="the `openai` client (test extra) is not installed")

from hybridmoe_jax import api  # noqa: E402
from hybridmoe_jax.infer import SamplingConfig  # noqa: E402
from hybridmoe_jax.rl import chat_format  # noqa: E402
from hybridmoe_jax.rl.chat_format import Message  # noqa: E402
from hybridmoe_jax.rl.envs.base import Answer, ToolCall  # noqa: E402
from hybridmoe_jax.serve.app import create_app  # noqa: E402
from hybridmoe_jax.serve.scheduler import Job, Scheduler  # noqa: E402
from tests.serve.fixtures import model_path  # noqa: E402,F401 (a fixture)
from tests.serve.fixtures import serve_in_thread  # noqa: E402

NAME = "tiny"
LONGEST = 24    # every reference generates this many tokens (one compilation) and is cut
# The scheduler's options in this module (the server and the hand-driven schedulers share
# their compilations): decode buckets 1, 2, 4; prefill buckets 1, 2; 4 steps per call.
SCHED = dict(decode_steps=4, prefill_rows=2)


@pytest.fixture(scope="module")
def lm(model_path):
  return api.load(model_path, max_len=64, prefill_chunk=8, kv_block=16)


def reference(lm, ids, max_tokens, stop_tokens=None, seed=0, **sampling):
  """`Engine.generate`'s ids for one prompt, cut to max_tokens (greedy and seeded sampling
  both continue a shorter run's tokens: the same key chain), through its first stop id."""
  stop = (lm.tokenizer.eos_id,) if stop_tokens is None else tuple(stop_tokens)
  out = lm.engine.generate(np.asarray(ids)[None], max_new_tokens=LONGEST, stop_tokens=stop,
                           sampling=SamplingConfig(vocab_limit=lm.tokenizer.vocab_size,
                                                   **sampling), seed=seed)
  return out.tokens[0, :min(max_tokens, out.lengths[0])].tolist()


def reference_text(lm, prompt, max_tokens, **sampling):
  """What `LoadedModel.generate` returns, from `reference`'s ids."""
  ids = reference(lm, lm.tokenizer.encode(prompt, bos=True), max_tokens, **sampling)
  return lm.tokenizer.decode([t for t in ids if t != lm.tokenizer.eos_id])


@pytest.fixture(scope="module")
def server(lm):
  app = create_app(lm, slots=4, model_name=NAME, **SCHED)
  with serve_in_thread(app) as url:
    yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120), app


def test_completion_stream_and_not_equal_generate(lm, server):
  client, _ = server
  models = client.models.list()
  assert [m.id for m in models.data] == [NAME]
  want = reference_text(lm, "Hello there", 12)
  got = client.completions.create(model=NAME, prompt="Hello there", max_tokens=12,
                                  temperature=0)
  assert got.choices[0].text == want
  ids = reference(lm, lm.tokenizer.encode("Hello there", bos=True), 12)
  assert got.usage.completion_tokens == len(ids)
  assert got.usage.prompt_tokens == len("Hello there") + 1
  assert got.choices[0].finish_reason == ("stop" if len(ids) < 12 else "length")
  pieces = list(client.completions.create(model=NAME, prompt="Hello there", max_tokens=12,
                                          temperature=0, stream=True))
  assert "".join(c.choices[0].text for c in pieces) == want
  assert pieces[-1].choices[0].finish_reason == got.choices[0].finish_reason
  # Token-id prompts are used as given; a list of prompts gives one choice each.
  both = client.completions.create(model=NAME, prompt=[[257, 72, 105], "Hi"], max_tokens=5,
                                   temperature=0)
  assert [c.text for c in both.choices] == [reference_text(lm, "Hi", 5)] * 2


def test_concurrent_requests_equal_generate_one_at_a_time(lm, server):
  """7 requests (prompts of 2..40 tokens: 1 to 5 prefill chunks, different max_tokens, one
  sampled with a seed) on 4 slots: they join and leave the batch, queue, and each equals
  `generate` of its prompt alone."""
  client, app = server
  prompts = ["a", "The quick brown fox jumps over the lazy dog, then", "Once upon",
             "x" * 39, "0123456789", "To be or not", "Hi!"]
  limits = [20, 6, 15, 9, 24, 3, 12]
  sampled = {4: dict(temperature=0.9, top_p=0.8, seed=11)}
  want = [reference_text(lm, p, m, **sampled.get(i, {}))
          for i, (p, m) in enumerate(zip(prompts, limits))]
  assert want[0] == lm.generate(prompts[0], max_new_tokens=limits[0])   # the reference
  before = dict(app.state.server.scheduler.stats)

  def ask(i):
    kw = sampled.get(i, dict(temperature=0))
    if i % 2:
      return "".join(c.choices[0].text for c in client.completions.create(
          model=NAME, prompt=prompts[i], max_tokens=limits[i], stream=True, **kw))
    return client.completions.create(model=NAME, prompt=prompts[i], max_tokens=limits[i],
                                     **kw).choices[0].text

  with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
    got = list(pool.map(ask, range(len(prompts)), timeout=300))
  assert got == want
  stats = app.state.server.scheduler.stats
  assert stats["admitted"] - before.get("admitted", 0) == len(prompts)
  assert stats["max_rows"] > 1          # requests really shared model calls


def test_chat_stream_and_not_equal_generate_of_the_rendered_turn(lm, server):
  client, _ = server
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  rendered = chat_format.render(lm.tokenizer, [Message("system", "Be brief."),
                                               Message("user", "2+2?")],
                                add_generation_prompt=True).ids
  roles = chat_format.chat_ids(lm.tokenizer)
  ids = reference(lm, rendered, 10, stop_tokens=(roles["end_turn"], lm.tokenizer.eos_id))
  got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                       temperature=0)
  assert got.usage.prompt_tokens == len(rendered)
  assert got.usage.completion_tokens == len(ids)
  if roles["tool_call"] not in ids:
    specials = set(lm.tokenizer.special_ids.values())
    assert got.choices[0].message.content == lm.tokenizer.decode(
        [t for t in ids if t not in specials])
  stream = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
  assert stream[0].choices[0].delta.role == "assistant"
  text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
  assert text == (got.choices[0].message.content or "")
  assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == \
      got.choices[0].finish_reason
  assert stream[-1].usage.completion_tokens == len(ids)


class _Scripted:
  """A scheduler stand-in that answers every job with fixed token ids."""

  def __init__(self, ids):
    self.ids, self.jobs, self.slots, self.busy = ids, [], 1, 0
    self.ready = threading.Event()
    self.ready.set()

  def start(self):
    return self

  def stop(self, drain=0.0):
    pass

  def submit(self, job):
    self.jobs.append(job)
    for t in self.ids:             # one id per event: the text must not depend on grouping
      job.emit(("tokens", [t]))
    job.emit(("done", "stop"))

  def cancel(self, job):
    pass


def test_tool_calls_round_trip_through_the_chat_format(model_path):
  lm = api.load(model_path, max_len=512, prefill_chunk=8, kv_block=16)   # the tools' prompt
  tok = lm.tokenizer
  roles = chat_format.chat_ids(tok)
  turn = chat_format.assistant_body(tok, Message("assistant", "let me see ",
                                                 ToolCall("calc", "6*7"))).tolist()
  app = create_app(lm, slots=1, model_name=NAME)
  scripted = _Scripted(turn)
  app.state.server.scheduler = scripted
  tools = [{"type": "function", "function": {"name": "calc", "description": "integers"}}]
  messages = [{"role": "user", "content": "6*7?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "c1", "type": "function",
                   "function": {"name": "calc", "arguments": json.dumps({"argument": "3+3"})}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "6"}]
  with serve_in_thread(app) as url:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    got = client.chat.completions.create(model=NAME, messages=messages, tools=tools)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, tools=tools,
                                                 stream=True))
  # The prompt: the tools' system turn, then the conversation in the RL chat format.
  want = chat_format.render(tok, [
      Message("system", chat_format.system_prompt(
          [type("T", (), {"name": "calc", "description": "integers"})])),
      Message("user", "6*7?"), Message("assistant", "", ToolCall("calc", "3+3")),
      Message("tool_result", "6")], add_generation_prompt=True).ids
  np.testing.assert_array_equal(scripted.jobs[0].prompt, want)
  assert scripted.jobs[0].stop_tokens == {roles["end_turn"], tok.eos_id}
  choice = got.choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content == "let me see "
  call = choice.message.tool_calls[0]
  assert call.function.name == "calc" and json.loads(call.function.arguments) == {
      "argument": "6*7"}
  deltas = [c.choices[0].delta for c in chunks]
  assert "".join(d.content or "" for d in deltas) == "let me see "
  streamed = [d.tool_calls[0] for d in deltas if d.tool_calls]
  assert len(streamed) == 1 and streamed[0].function.arguments == call.function.arguments
  assert chunks[-1].choices[0].finish_reason == "tool_calls"
  # An answer turn comes back as content.
  scripted.ids = chat_format.assistant_body(tok, Message("assistant", "", Answer("42"))).tolist()
  with serve_in_thread(app) as url:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model=NAME, messages=messages[:1])
  assert answer.choices[0].message.content == "42"
  assert answer.choices[0].finish_reason == "stop"


def test_bad_requests_get_4xx_with_a_message(lm, server):
  client, _ = server
  cases = [
      (dict(prompt="hi", n=2), 400, "n"),
      (dict(prompt="x" * 60, max_tokens=10), 400, "exceed this model's context of 64"),
      (dict(prompt="hi", temperature=3.0), 400, "temperature"),
      (dict(prompt="hi", top_p=0.0), 400, "top_p"),
      (dict(prompt=[1, 999], max_tokens=2), 400, "token id 999 is outside"),
      (dict(prompt="hi", logprobs=2), 400, "logprobs"),
      (dict(prompt="", max_tokens=2), 400, "prompt"),
      (dict(prompt="hi", max_tokens=0), 400, "max_tokens"),
      (dict(prompt="hi", stop=[1]), 400, "stop"),
  ]
  for kwargs, status, words in cases:
    with pytest.raises(openai.APIStatusError) as e:
      client.completions.create(model=NAME, **kwargs)
    assert e.value.status_code == status and words in e.value.message, (kwargs, e.value)
    assert e.value.body["type"] == "invalid_request_error"
  with pytest.raises(openai.NotFoundError, match="not served here"):
    client.completions.create(model="gpt-9", prompt="hi")
  with pytest.raises(openai.BadRequestError, match="role"):
    client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}])
  with pytest.raises(openai.BadRequestError, match="leave no room"):
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "y" * 70}])
  request = urllib.request.Request(str(client.base_url) + "completions", data=b"{not json",
                                   headers={"Content-Type": "application/json"})
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(request, timeout=30)
  assert e.value.code == 400
  assert "not valid JSON" in json.loads(e.value.read())["error"]["message"]


def test_a_long_prompt_is_prefilled_between_decode_steps(lm):
  """While a 5-chunk prompt is prefilled, a running request gets one token per iteration
  (chunked prefill interleaved with single decode steps); alone, it gets up to 4 per call;
  both equal generate."""
  # The server fixture's options: the same compiled shapes. Driven by hand: no thread.
  sched = Scheduler(lm.engine, slots=4, vocab_limit=lm.tokenizer.vocab_size, **SCHED)
  events = {"a": [], "b": []}
  short = lm.tokenizer.encode("ab", bos=True)
  long = lm.tokenizer.encode("z" * 36, bos=True)           # 37 tokens: 5 chunks of 8
  a = Job(short, LONGEST, events["a"].append)
  b = Job(long, 4, events["b"].append)
  drawn = lambda name: sum(len(v) for kind, v in events[name] if kind == "tokens")  # noqa
  sched.submit(a)
  sched._iteration()          # prefill (draws the first token), then 4 decode steps
  assert drawn("a") == 5 and len(events["a"]) == 2      # streamed in 2 events
  sched.submit(b)
  for k in range(5):
    sched._iteration()
    assert b.fed == min(8 * (k + 1), 37)
    assert drawn("a") == 5 + (k + 1 if k < 4 else 8)    # b's first token ends the joining
  assert sched.stats["prefill_calls"] == 6 and sched.stats["max_rows"] == 2
  while sched.busy:
    sched._iteration()
  for job, name in ((a, "a"), (b, "b")):
    toks = [t for kind, v in events[name] if kind == "tokens" for t in v]
    assert toks == reference(lm, job.prompt, job.max_tokens, stop_tokens=())
    assert events[name][-1] == ("done", "length")


def test_the_command_line_serves_and_refuses_bad_flags(model_path, capsys):
  """`python -m hybridmoe_jax.serve --workdir=...` answers /v1/models; bad flags and paths
  are one-line errors (exit 2)."""
  import socket
  import subprocess
  import sys
  import time

  from hybridmoe_jax.serve.__main__ import main
  assert main([f"--workdir={model_path}", "--slots=0"]) == 2
  assert main(["--workdir=/nonexistent/run"]) == 2
  assert main([f"--workdir={model_path}", "--decode_steps=0"]) == 2
  assert main([f"--workdir={model_path}", "--prefix_cache_mb=-1"]) == 2
  err = capsys.readouterr().err
  assert "--slots=0 is invalid" in err and "does not exist" in err
  assert "--decode_steps=0 is invalid" in err and "--prefix_cache_mb=-1 is invalid" in err
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen([sys.executable, "-m", "hybridmoe_jax.serve",
                           f"--workdir={model_path}", f"--port={port}", "--max_len=64"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline, models = time.monotonic() + 180, None
    while models is None and time.monotonic() < deadline and proc.poll() is None:
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
          models = json.loads(r.read())
      except OSError:
        time.sleep(0.5)
    assert models is not None, proc.stderr.read() if proc.poll() is not None else "timeout"
    assert models["data"][0]["id"] == "chat_model" and models["data"][0]["max_model_len"] == 64
  finally:
    proc.terminate()
    proc.wait(30)


def test_stop_strings_cut_the_text_and_end_the_request(lm, server):
  client, _ = server
  prompt = next(p for p in ("Once upon", "a", "Hi!", "To be or not")
                if len(reference_text(lm, p, LONGEST)) >= 8)
  full = reference_text(lm, prompt, LONGEST)
  stop = full[5:7]
  want = full[:full.find(stop)]
  got = client.completions.create(model=NAME, prompt=prompt, max_tokens=LONGEST,
                                  temperature=0, stop=[stop, "never appears"])
  assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
  # Generation ended at the stop string: no more tokens than the run without it.
  assert got.usage.completion_tokens <= len(reference(lm, lm.tokenizer.encode(prompt, bos=True),
                                                      LONGEST))
  chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=LONGEST,
                                          temperature=0, stop=stop, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == want
  assert chunks[-1].choices[0].finish_reason == "stop"


def _metrics(client) -> dict[str, str]:
  base = str(client.base_url).rstrip("/").rsplit("/v1", 1)[0]
  with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
    text = r.read().decode()
  return dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))


def test_a_stop_string_counts_as_a_stop_in_metrics(lm, server):
  """A request ended by its stop string is cancelled in the scheduler (so it stops drawing)
  but finished "stop" for the client: /metrics counts it as "stop", not as a gone client."""
  client, _ = server
  prompt = next(p for p in ("Once upon", "a", "Hi!", "To be or not", "x")
                if len(reference(lm, lm.tokenizer.encode(p, bos=True), LONGEST)) == LONGEST
                and len(reference_text(lm, p, LONGEST)) >= 12)
  full = reference_text(lm, prompt, LONGEST)
  before = _metrics(client)
  got = client.completions.create(model=NAME, prompt=prompt, max_tokens=LONGEST,
                                  temperature=0, stop=[full[3:5]])
  assert got.choices[0].finish_reason == "stop"
  after = _metrics(client)
  finished = lambda m, k: int(m[f'hybridmoe_requests_total{{finish="{k}"}}'])  # noqa: E731
  assert finished(after, "stop") - finished(before, "stop") == 1
  assert finished(after, "cancelled") == finished(before, "cancelled")


def test_metrics_and_health_after_warm_up(server):
  client, app = server
  client.completions.create(model=NAME, prompt="metrics", max_tokens=3, temperature=0)
  base = str(client.base_url).rstrip("/").rsplit("/v1", 1)[0]
  with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.read().decode()
  samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
  assert int(samples['hybridmoe_requests_total{finish="length"}']) >= 1
  assert int(samples["hybridmoe_generation_tokens_total"]) >= 3
  assert int(samples["hybridmoe_time_to_first_token_seconds_count"]) >= 1
  assert samples["hybridmoe_ready"] == "1" and samples["hybridmoe_requests_running"] == "0"
  with urllib.request.urlopen(base + "/health", timeout=30) as r:
    health = json.loads(r.read())
  assert health["status"] == "ok" and health["compiled"] == health["of"] > 0


def test_health_is_503_while_warming_up_and_requests_wait(lm):
  """Until warm-up has compiled every shape /health answers 503 "warming_up"; a request
  sent meanwhile is answered once it is done."""
  app = create_app(lm, slots=4, model_name=NAME, **SCHED)
  sched = app.state.server.scheduler
  release, real = threading.Event(), sched.warm_up

  def held_warm_up():
    release.wait(60)
    real()                 # the shapes are the server fixture's: already compiled
  sched.warm_up = held_warm_up
  with serve_in_thread(app) as url:
    base = url.rsplit("/v1", 1)[0]
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(base + "/health", timeout=30)
    assert e.value.code == 503 and json.loads(e.value.read())["status"] == "warming_up"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      answer = pool.submit(client.completions.create, model=NAME, prompt="wait",
                           max_tokens=4, temperature=0)
      time.sleep(0.5)
      assert not answer.done() and sched.waiting == 1
      release.set()
      assert answer.result(timeout=120).choices[0].text == reference_text(lm, "wait", 4)


@pytest.mark.slow
def test_sigterm_lets_running_requests_finish(model_path):
  """`python -m hybridmoe_jax.serve`: SIGTERM while requests run and wait -> every one is
  answered in full (greedy text equal to generate's), then the process exits."""
  import signal
  import socket
  import subprocess
  import sys

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen([sys.executable, "-m", "hybridmoe_jax.serve", f"--workdir={model_path}",
                           f"--port={port}", "--max_len=1024", "--prefill_chunk=8", "--slots=2",
                           "--decode_steps=4", "--prefill_rows=1", "--shutdown_timeout=60"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
      try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
        break                               # 200: warmed up
      except OSError:
        time.sleep(0.5)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    prompts = ["hi", "Once upon", "Hi!", "0123456789"]      # 2 run, 2 wait for a slot
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
      answers = [pool.submit(client.completions.create, model="chat_model", prompt=p,
                             max_tokens=1000, temperature=0) for p in prompts]
      while json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                              timeout=5).read())["busy"] < len(prompts):
        time.sleep(0.01)
      proc.send_signal(signal.SIGTERM)
      texts = [a.result(timeout=120).choices[0].text for a in answers]
    assert proc.wait(60) in (0, -signal.SIGTERM)   # uvicorn re-raises the signal at exit
  finally:
    proc.kill()
    proc.wait(30)
  lm = api.load(model_path, max_len=1024, prefill_chunk=8)
  assert texts == [lm.generate(p, max_new_tokens=1000) for p in prompts]
  assert proc.stderr.read().count(" request cmpl-") == len(prompts)   # one log line each
