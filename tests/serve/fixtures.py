"""A tiny hybrid model (1 KDA + 1 MLA layer, random weights) saved as a params export with the
chat byte tokenizer: what the server, the chat REPL and the lm-eval adapter tests load
(`model_path`: the module-scoped fixture; import it into a test module to use it); and
`serve_in_thread`, an app served on a free local port for the HTTP tests."""

import contextlib
import dataclasses
import pathlib
import socket
import threading
import time

import pytest
from flax import nnx

from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.data.tokenizers.load import save_tokenizer
from hybridmoe_jax.layers.moe import RoutingBias
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.train.params_export import export_params
from tests._support import tiny_model_config

CHAT_VOCAB = ByteTokenizer(chat=True).vocab_size       # 266


def write_chat_model(root: pathlib.Path, seed: int = 0) -> str:
  """-> the path of a params export (+ tokenizer/) of a random 2-layer chat model."""
  cfg = tiny_model_config(num_layers=2, layer_kinds=("kda", "mla"), vocab_size=CHAT_VOCAB)
  model = HybridLM(cfg, rngs=nnx.Rngs(seed))
  _, params, biases, _ = nnx.split(model, nnx.Param, RoutingBias, ...)
  path = export_params(str(root / "chat_model"), params, biases, dataclasses.asdict(cfg))
  save_tokenizer(ByteTokenizer(chat=True), str(root / "chat_model" / "tokenizer"))
  return path


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", timeout: float = 60.0, limits=None):
  """Run `app` with uvicorn on a free port of `host` in a daemon thread, with the same settings
  as `python -m hybridmoe_jax.serve` under `limits` (a serve.guard.HttpLimits; None: the
  defaults) -> yields the base URL ("http://host:port/v1"); shut down on exit."""
  # pylint: disable=import-outside-toplevel  (uvicorn: the serve extra, absent for some tests)
  import uvicorn
  from hybridmoe_jax.serve.guard import HttpLimits, uvicorn_config
  sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, 0))
  port = sock.getsockname()[1]
  server = uvicorn.Server(uvicorn_config(app, limits or HttpLimits(), lifespan="on"))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  deadline = time.monotonic() + timeout
  while not server.started:
    if not thread.is_alive() or time.monotonic() > deadline:
      server.should_exit = True
      sock.close()
      raise RuntimeError(f"the server on {host}:{port} did not start within {timeout} s")
    time.sleep(0.02)
  try:
    yield f"http://{host}:{port}/v1"
  finally:
    server.should_exit = True
    thread.join(timeout)
    sock.close()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
  """One chat model per test module."""
  return write_chat_model(tmp_path_factory.mktemp("chat_model"))
