"""The load-sized scheduler without HTTP: bucketed calls compiled once at warm-up (no trace
after it during a mixed workload), outputs equal to `Engine.generate`, the prefix cache
(a hit equals the uncached run; LRU bound; a follower waits for the shared prefill),
metrics in Prometheus' text format, one log line per request, draining shutdown."""

import logging
import threading

import jax
import numpy as np
import pytest

from hybridmoe_jax import api
from hybridmoe_jax.infer import SamplingConfig, trace_counts
from hybridmoe_jax.serve.metrics import Histogram, Metrics
from hybridmoe_jax.serve.prefix_cache import PrefixCache, shared_boundary
from hybridmoe_jax.serve.scheduler import Job, Scheduler
from tests.serve.fixtures import model_path  # noqa: F401 (a fixture)

LONGEST = 24
# Decode buckets 1, 2, 4; prefill buckets 1, 2; 4 steps per call (tests/serve/test_server.py's
# options: the persistent compilation cache serves both modules).
SCHED = dict(slots=4, decode_steps=4, prefill_rows=2)


@pytest.fixture(scope="module")
def lm(model_path):
  return api.load(model_path, max_len=64, prefill_chunk=8, kv_block=16)


@pytest.fixture(scope="module")
def warm(lm):
  """A warmed-up scheduler with the prefix cache (driven by hand in the tests: no thread)."""
  sched = Scheduler(lm.engine, vocab_limit=lm.tokenizer.vocab_size, prefix_cache_bytes=1 << 20,
                    **SCHED)
  sched.warm_up()
  return sched


def reference(lm, prompt, max_tokens, stop=(), seed=0, **sampling):
  out = lm.engine.generate(np.asarray(prompt)[None], max_new_tokens=LONGEST, stop_tokens=stop,
                           sampling=SamplingConfig(vocab_limit=lm.tokenizer.vocab_size,
                                                   **sampling), seed=seed)
  return out.tokens[0, :min(max_tokens, out.lengths[0])].tolist()


def drawn(events):
  return [t for kind, v in events if kind == "tokens" for t in v]


def run(sched, jobs, late=(), every=3):
  """Submit `jobs`, then one of `late` every `every` iterations, until all are done."""
  for job in jobs:
    sched.submit(job)
  late, i = list(late), 0
  while sched.busy or late:
    if late and i % every == 0:
      sched.submit(late.pop(0))
    sched._iteration()
    i += 1


def test_mixed_workload_traces_nothing_after_warm_up_and_equals_generate(lm, warm, caplog):
  """Prompts of 1 to 6 chunks, different max_tokens, EOS stops, one sampled with a seed, one
  cancelled, two sharing a prefix, jobs joining mid-run: every bucket is used and nothing is
  traced (so nothing compiled) after warm-up; each job equals generate of its prompt alone."""
  enc = lambda text: lm.tokenizer.encode(text, bos=True)  # noqa: E731
  texts = ["a", "The quick brown fox jumps over the lazy dog, then", "Once upon",
           "x" * 39, "0123456789", "To be or not", "Hi!", "The quick brown fox jumps high",
           "q" * 45]
  limits = [20, 6, 15, 9, 24, 3, 12, 10, 2]
  sampled = {4: dict(temperature=0.9, top_p=0.8, seed=11)}
  eos = frozenset({lm.tokenizer.eos_id})
  events = [[] for _ in texts]
  jobs = [Job(enc(t), m, events[i].append, stop_tokens=eos, **sampled.get(i, {}))
          for i, (t, m) in enumerate(zip(texts, limits))]
  doomed = Job(enc("cancel me"), 20, lambda e: None)
  before = trace_counts()
  compiles = []        # every XLA compilation in the process (the PRNG key's included)

  def listen(event, seconds, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(seconds)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    with caplog.at_level(logging.INFO, logger="hybridmoe_jax.serve"):
      warm.submit(doomed)
      warm._iteration()
      warm.cancel(doomed)
      run(warm, jobs[:5], late=jobs[5:])
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert trace_counts() == before and not compiles   # no request compiled
  used = {k for k in warm.batch.calls}
  assert {("decode", b) for b in (1, 2, 4)} <= used and ("prefill", 2) in used, used
  for i, job in enumerate(jobs):
    want = reference(lm, job.prompt, job.max_tokens, stop=(lm.tokenizer.eos_id,),
                     **sampled.get(i, {}))
    assert drawn(events[i]) == want, i
    assert events[i][-1] == ("done", "stop" if want[-1] == lm.tokenizer.eos_id else "length")
  assert jobs[7].cached == 24            # "The quick brown fox jump" from job 1's snapshot
  lines = [r.getMessage() for r in caplog.records if r.name == "hybridmoe_jax.serve"]
  assert len(lines) == len(jobs) + 1 and any("cancelled" in x for x in lines)
  assert any(f"request {jobs[7].name}: " in x and "(24 cached)" in x for x in lines)


def test_a_prefix_cache_hit_equals_the_uncached_run_and_a_follower_waits(lm, warm):
  """Two prompts sharing 40 tokens, submitted together: the second waits for the first's
  prefill to pass the shared boundary, then starts from its snapshot; both equal generate
  (the uncached runs)."""
  shared = lm.tokenizer.encode("Shared system prompt, forty tokens long!", bos=True)[:40]
  a = np.concatenate([shared, lm.tokenizer.encode("first", bos=False)])
  b = np.concatenate([shared, lm.tokenizer.encode("and the second", bos=False)])
  ev_a, ev_b = [], []
  hits = warm.prefix.stats["hits"]
  run(warm, [Job(a, 10, ev_a.append), job_b := Job(b, 10, ev_b.append)])
  assert job_b.cached == 40 and warm.prefix.stats["hits"] == hits + 1
  assert drawn(ev_a) == reference(lm, a, 10) and drawn(ev_b) == reference(lm, b, 10)


def test_prefix_cache_bounds_and_counts():
  cache = PrefixCache(chunk=4, capacity=2)
  p = np.arange(20, dtype=np.int32)
  assert cache.usable(p[:9]) == 8 and cache.usable(p[:8]) == 4 and cache.usable(p[:4]) == 0
  assert not cache.wants(p, 6) and cache.wants(p, 8)
  for n in (4, 8, 12):
    cache.insert(p, n, f"row after {n}")
  assert len(cache) == 2 and cache.stats["evictions"] == 1      # 4 went first (LRU)
  assert cache.lookup(p[:13]) == (12, "row after 12")
  assert cache.lookup(p[:12]) == (8, "row after 8")             # leaves a token to feed
  assert cache.lookup(p[:7]) == (0, None)                       # 4 was evicted
  assert (cache.stats["hits"], cache.stats["misses"], cache.stats["hit_tokens"]) == (2, 1, 20)
  cache.insert(p, 16, "row after 16")                           # evicts 12: 8 was used last
  assert cache.cached_length(p) == 16 and cache.lookup(p[:16])[0] == 8
  other = p.copy()
  other[9] = 99
  assert shared_boundary(p, other, 4) == 8 and shared_boundary(p, p[:9], 4) == 8
  with pytest.raises(ValueError, match="capacity=0 is invalid"):
    PrefixCache(4, 0)


def test_metrics_render_prometheus_text():
  h = Histogram((0.1, 1.0))
  h.observe(0.05)
  h.observe(0.5, times=2)
  h.observe(7.0)
  assert h.lines("x") == ['x_bucket{le="0.1"} 1', 'x_bucket{le="1.0"} 3',
                          'x_bucket{le="+Inf"} 4', "x_sum 8.05", "x_count 4"]
  m = Metrics()
  m.first_token(0.02)
  m.tokens(1, None)
  m.tokens(3, 0.004)
  m.request_done("length", prompt_tokens=9, cached_tokens=8)
  text = m.render(running=1, waiting=2, ready=True, compiled=7, prefix={"hits": 3},
                  prefix_entries=5)
  samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
  assert samples["hybridmoe_requests_running"] == "1"
  assert samples["hybridmoe_requests_waiting"] == "2"
  assert samples['hybridmoe_requests_total{finish="length"}'] == "1"
  assert samples["hybridmoe_generation_tokens_total"] == "4"
  assert samples["hybridmoe_prompt_tokens_cached_total"] == "8"
  assert samples['hybridmoe_time_per_output_token_seconds_bucket{le="0.005"}'] == "3"
  assert samples["hybridmoe_time_to_first_token_seconds_count"] == "1"
  assert samples["hybridmoe_prefix_cache_hits_total"] == "3"
  assert samples["hybridmoe_prefix_cache_misses_total"] == "0"
  assert float(samples["hybridmoe_generation_tokens_per_second"]) == 4 / m.window_s
  assert text.count("# TYPE") == text.count("# HELP") and text.endswith("\n")


def test_metrics_keep_only_the_rate_window_without_scrapes(monkeypatch):
  """A server nobody scrapes records a token emission per request per call for its whole
  life: only the last window_s seconds of them may be kept (else memory grows forever)."""
  clock = [1000.0]
  monkeypatch.setattr("hybridmoe_jax.serve.metrics.time.monotonic", lambda: clock[0])
  m = Metrics(window_s=10.0)
  for _ in range(10_000):
    m.tokens(2, 0.001)
    clock[0] += 0.1
  assert len(m._recent) <= 101
  assert m.totals["generation_tokens"] == 20_000
  assert m.tokens_per_second() == pytest.approx(2 * 100 / 10.0)


def test_shutdown_drains_running_jobs_then_cancels(lm, warm):
  """stop(drain=...) refuses new jobs and lets running ones finish; with no drain time left,
  the rest are cancelled."""
  sched = Scheduler(lm.engine, vocab_limit=lm.tokenizer.vocab_size, **SCHED)
  sched.ready.set()                  # the shapes are warm's (the same options)
  sched.start()
  enc = lm.tokenizer.encode("drain", bos=True)
  finished, ended = [], threading.Event()
  job = Job(enc, 20, lambda e: (finished.append(e), e[0] != "tokens" and ended.set()))
  sched.submit(job)
  sched.stop(drain=120)
  assert ended.is_set() and finished[-1] == ("done", "length")
  assert drawn(finished) == reference(lm, enc, 20)
  with pytest.raises(RuntimeError, match="stopped"):
    sched.submit(Job(enc, 2, lambda e: None))
  sched = Scheduler(lm.engine, vocab_limit=lm.tokenizer.vocab_size, **SCHED)
  sched.ready.set()
  events = []
  sched.submit(Job(enc, 50, events.append))      # queued, never run: stop at once
  sched.start()
  sched.stop(drain=0)
  assert events[-1] == ("done", "cancelled")


def test_bad_options_are_one_line_errors(lm):
  for kwargs, words in ((dict(slots=0), "slots=0"), (dict(decode_steps=0), "decode_steps=0"),
                        (dict(prefix_cache_bytes=-1), "prefix_cache_bytes=-1")):
    with pytest.raises(ValueError, match=words):
      Scheduler(lm.engine, **kwargs)
  lines = []
  sched = Scheduler(lm.engine, slots=1, prefix_cache_bytes=10, progress=lines.append)
  assert sched.prefix is None and "prefix cache off: 10 bytes hold no cache row" in lines[0]
  with pytest.raises(ValueError, match="stop_tokens: 9 ids"):
    sched.submit(Job(np.ones(2, np.int32), 2, lambda e: None, stop_tokens=frozenset(range(9))))
