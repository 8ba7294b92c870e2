"""A tiny hybrid model (1 KDA + 1 MLA layer, random weights) saved as a params export with the
chat byte tokenizer: what the server, the chat REPL and the lm-eval adapter tests load
(`model_path`: the module-scoped fixture; import it into a test module to use it)."""

import dataclasses
import pathlib

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


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
  """One chat model per test module."""
  return write_chat_model(tmp_path_factory.mktemp("chat_model"))
