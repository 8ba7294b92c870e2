"""`python -m hybridmoe_jax.serve --workdir=DIR`: serve a model over the OpenAI API.

DIR is anything `hybridmoe_jax.load` reads (a training workdir, a params export, a
converted Hugging Face dir). Then, e.g.:
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "default", "prompt": "The ", "max_tokens": 32}'
or the `openai` client with base_url="http://localhost:8000/v1" (any api_key).
"""

from __future__ import annotations

import argparse
import os
import sys


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
  p.add_argument("--dtype", default=None, help="compute dtype (float32, bfloat16); default: "
                 "the stored one")
  p.add_argument("--model_name", default=None, help="the id clients send as `model` "
                 "(default: the directory's name)")
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  for name in ("slots", "max_len", "prefill_chunk"):
    if getattr(args, name) < 1:
      print(f"error: --{name}={getattr(args, name)} is invalid: allowed an integer >= 1",
            file=sys.stderr)
      return 2
  try:
    import uvicorn
    from hybridmoe_jax.serve.app import create_app
  except ImportError as e:
    print(f"error: the server needs the `serve` extra ({e.name} is missing): "
          "pip install -e '.[serve]'", file=sys.stderr)
    return 2
  from hybridmoe_jax.api import load
  try:
    lm = load(args.workdir, dtype=args.dtype, max_len=args.max_len,
              prefill_chunk=args.prefill_chunk)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  name = args.model_name or os.path.basename(os.path.normpath(args.workdir))
  print(f"serving {lm!r} as {name!r} on http://{args.host}:{args.port}/v1 with "
        f"{args.slots} slots", file=sys.stderr)
  uvicorn.run(create_app(lm, slots=args.slots, model_name=name), host=args.host,
              port=args.port, log_level="warning")
  return 0


if __name__ == "__main__":
  sys.exit(main())
