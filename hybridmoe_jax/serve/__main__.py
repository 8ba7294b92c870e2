"""`python -m hybridmoe_jax.serve --workdir=DIR`: serve a model over the OpenAI API.

DIR is anything `hybridmoe_jax.load` reads (a training workdir, a params export, a
converted Hugging Face dir). Then, e.g.:
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "default", "prompt": "The ", "max_tokens": 32}'
or the `openai` client with base_url="http://localhost:8000/v1" (any api_key, unless the
server has one: --api-key or $HYBRIDMOE_API_KEY, then that key).

Limits against slow or hostile clients (guard.py): --limit_concurrency connections (the
longest-waiting idle one is closed for a new one; 503 when all are answering),
--timeout_read seconds for a request's headers and body (408) and for a client that stops
reading, --timeout_keep_alive for an idle connection, --max_body_bytes per body (413).

Scheduling (scheduler.py): every decode bucket (1, 2, 4, ... --slots rows) and prefill
bucket is compiled before the first request is served (a progress line each; /health says
"warming_up" until then); --decode_steps tokens per host round trip when no request waits
to join; --prefix_cache_mb of cache-row snapshots reused by prompts that share a prefix.
GET /metrics: Prometheus text. One log line per request. SIGINT / SIGTERM: running requests
get --shutdown_timeout seconds to finish, then are cancelled.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys

from hybridmoe_jax.serve.protocol import MAX_BODY_BYTES


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m hybridmoe_jax.serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True, help="model to serve (workdir, params export "
                 "or HF dir)")
  p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default "
                 "127.0.0.1; 0.0.0.0 for every interface)")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--slots", type=int, default=8, help="cache rows decoded together "
                 "(concurrent requests; more wait in a queue)")
  p.add_argument("--max_len", type=int, default=2048, help="tokens per cache row: prompt + "
                 "max_tokens of one request must fit")
  p.add_argument("--prefill_chunk", type=int, default=128, help="prompt tokens fed per "
                 "scheduler iteration (between two decode steps of the running requests)")
  p.add_argument("--decode_steps", type=int, default=16, help="most decode steps per "
                 "scheduler call (tokens streamed per chunk) while no request waits to join")
  p.add_argument("--prefill_rows", type=int, default=16, help="most prompts fed a chunk "
                 "in one call (up to prefill_rows x prefill_chunk tokens per iteration; "
                 "buckets 1, 2, 4, ... compiled up to min(it, slots))")
  p.add_argument("--prefix_cache_mb", type=int, default=256, help="memory for prompt-prefix "
                 "snapshots (KDA states + MLA latents of one cache row each; 0: off)")
  p.add_argument("--shutdown_timeout", type=float, default=30.0, help="seconds running "
                 "requests get to finish at shutdown before they are cancelled")
  p.add_argument("--dtype", default=None, help="compute dtype (float32, bfloat16); default: "
                 "the stored one")
  p.add_argument("--model_name", default=None, help="the id clients send as `model` "
                 "(default: the directory's name)")
  p.add_argument("--api_key", "--api-key", default=None, help="require `Authorization: "
                 "Bearer <key>` on every route but /health (default: $HYBRIDMOE_API_KEY, "
                 "which keeps the key out of `ps`; unset or empty: no key)")
  p.add_argument("--limit_concurrency", type=int, default=256, help="connections open at "
                 "once (default 256): past it a new one closes the longest-waiting one not "
                 "being answered, or gets 503 when all are")
  p.add_argument("--timeout_read", type=float, default=30.0, help="seconds a request's "
                 "headers and body may take to arrive from its first byte (default 30; "
                 "then 408 and the connection is closed); also how long a client may stop "
                 "reading a response once the socket's buffers are full (then aborted)")
  p.add_argument("--timeout_keep_alive", type=float, default=5.0, help="seconds an idle "
                 "connection is kept between requests (default 5, uvicorn's)")
  p.add_argument("--max_body_bytes", type=int, default=MAX_BODY_BYTES, help="largest "
                 "request body (default 16 MiB; 413 beyond)")
  return p


def _raise_fd_limit(needed: int) -> str | None:
  """Raise the soft open-file limit towards `needed` -> a warning when it stays lower (the
  listening socket, the model's files and the loop need some beyond the connections)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft != resource.RLIM_INFINITY and soft < needed:
    top = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
    soft = top
  if soft != resource.RLIM_INFINITY and soft < needed:
    return (f"warning: the open-file limit is {soft}, under the {needed} that "
            f"--limit_concurrency needs; lower it or raise `ulimit -n`")
  return None


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  for name in ("slots", "max_len", "prefill_chunk", "max_body_bytes", "decode_steps",
               "prefill_rows"):
    if getattr(args, name) < 1:
      print(f"error: --{name}={getattr(args, name)} is invalid: allowed an integer >= 1",
            file=sys.stderr)
      return 2
  for name in ("prefix_cache_mb", "shutdown_timeout"):
    if getattr(args, name) < 0:
      print(f"error: --{name}={getattr(args, name)} is invalid: allowed a number >= 0",
            file=sys.stderr)
      return 2
  try:
    import uvicorn
    from hybridmoe_jax.serve import guard
    from hybridmoe_jax.serve.app import create_app
  except ImportError as e:
    print(f"error: the server needs the `serve` extra ({e.name} is missing): "
          "pip install -e '.[serve]'", file=sys.stderr)
    return 2
  try:
    limits = guard.HttpLimits(args.limit_concurrency, args.timeout_keep_alive,
                              args.timeout_read)
  except ValueError as e:
    print(f"error: --{e}", file=sys.stderr)
    return 2
  from hybridmoe_jax.api import load
  try:
    lm = load(args.workdir, dtype=args.dtype, max_len=args.max_len,
              prefill_chunk=args.prefill_chunk)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  name = args.model_name or os.path.basename(os.path.normpath(args.workdir))
  api_key = args.api_key if args.api_key is not None else os.environ.get(guard.API_KEY_ENV)
  print(f"serving {lm!r} as {name!r} on http://{args.host}:{args.port}/v1 with "
        f"{args.slots} slots; API key: " + ("required (Authorization: Bearer)" if api_key
                                             else "none"), file=sys.stderr)
  if not api_key and not guard.is_loopback(args.host):
    print(f"warning: {args.host} is reachable from other machines and no API key is set: "
          f"anyone who can reach it can use the model (--api-key or ${guard.API_KEY_ENV})",
          file=sys.stderr)
  warning = _raise_fd_limit(args.limit_concurrency + 64)
  if warning:
    print(warning, file=sys.stderr)
  # The scheduler's warm-up progress and the one line per request.
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
  serve_log = logging.getLogger("hybridmoe_jax.serve")
  serve_log.addHandler(handler)
  serve_log.setLevel(logging.INFO)
  serve_log.propagate = False          # a root handler (absl's) would print each line twice
  app = create_app(lm, slots=args.slots, model_name=name, api_key=api_key,
                   max_body_bytes=args.max_body_bytes, shutdown_drain=args.shutdown_timeout,
                   decode_steps=args.decode_steps, prefill_rows=args.prefill_rows,
                   prefix_cache_bytes=args.prefix_cache_mb << 20)
  # uvicorn first waits (up to the timeout) for open responses, then the lifespan drains
  # and cancels what is left.
  server = uvicorn.Server(guard.uvicorn_config(app, limits, host=args.host, port=args.port,
                                               timeout_graceful_shutdown=args.shutdown_timeout))
  server.run()
  return 0 if server.started else 1     # e.g. the port is taken (uvicorn said why)


if __name__ == "__main__":
  sys.exit(main())
