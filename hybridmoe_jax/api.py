"""A Python API for notebooks: `load(path)` -> a `LoadedModel` with generate, chat, score,
forward.

`load` reads any of the three layouts the model loader knows (`hybridmoe_jax.loading`: a
training workdir's newest good checkpoint, read-only; a params export; a converted Hugging
Face dir), recognised from the files in `path`, with the tokenizer stored beside, and
returns a `LoadedModel` (`infer.loaded_model`): the HybridLM, its ModelConfig, the tokenizer
and the loader's info, with text-in / text-out calls on top of `infer.Engine` (chunked
prefill, cached decode, one compilation per shape bucket). `LoadedModel.chat`
(defined here: the chat format lives in `rl.chat_format`, above `infer`) answers a
conversation in the same format as the server's /v1/chat/completions.

Sharding (`mesh=`): None keeps the model on the default device; "auto" (every device on the
`fsdp` axis), a {axis: size} dict (see `parallel.mesh.build_mesh`) or a `jax.sharding.Mesh`
places every parameter with the project's rules (`parallel.rules.tree_shardings`), and XLA
partitions the engine's jitted steps from those placements: the same call runs on one CPU or
a TPU VM. The weights are read whole, then placed, so they must fit in host memory, and the
mesh must be one process's devices.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from hybridmoe_jax import loading
from hybridmoe_jax.config import DTYPES
from hybridmoe_jax.infer.engine import require_count
from hybridmoe_jax.infer import loaded_model
from hybridmoe_jax.infer.streaming import stream_text
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.parallel.mesh import build_mesh
from hybridmoe_jax.parallel.rules import tree_shardings
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.chat_format import Message
from hybridmoe_jax.rl.envs.base import Answer
from hybridmoe_jax.config.sharding import MESH_AXES


# ------------------------------------------------------------------------------------ chat
def chat_messages(messages) -> list[Message]:
  """OpenAI-style messages -> chat_format Messages, the server's mapping: system / developer
  -> system, user, assistant (its content as the answer), tool -> tool_result; a
  chat_format.Message passes as it is.

  Raises:
    ValueError: not a non-empty list, or a message that is not {"role", "content": str} with
      an allowed role (one line naming messages[i]).
  """
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ValueError("chat: messages must be a non-empty list of {\"role\", \"content\"} "
                     f"dicts, got {type(messages).__name__}")
  out = []
  for i, m in enumerate(messages):
    if isinstance(m, Message):
      out.append(m)
      continue
    role = m.get("role") if isinstance(m, dict) else None
    if not isinstance(role, str) or role not in chat_format.OPENAI_ROLES:   # (list: unhashable)
      raise ValueError(f"chat: messages[{i}].role = {role!r} is invalid: allowed "
                       f"{sorted(chat_format.OPENAI_ROLES)}")
    content = m.get("content")
    if not isinstance(content, str):
      raise ValueError(f"chat: messages[{i}].content must be a str, got "
                       f"{type(content).__name__}")
    out.append(Message("assistant", "", Answer(content)) if role == "assistant"
               else Message(chat_format.OPENAI_ROLES[role], content))
  return out


class LoadedModel(loaded_model.LoadedModel):
  """`infer.loaded_model.LoadedModel` with `chat` (what `load` returns)."""

  def chat(self, messages, *, max_new_tokens: int = 256, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           stop: str | Sequence[str] = ()) -> str:
    """The assistant's reply to a conversation, in the server's chat format.

    The conversation is rendered as /v1/chat/completions renders it (`rl.chat_format`: BOS,
    each turn between its role id and <end_turn>, then the <assistant> header) and the reply
    is generated until <end_turn> or EOS. Like the server's `content`, the text is what
    comes before a <tool_call> with the special ids left out, cut at a `stop` string.

    Args:
      messages: [{"role": "system" | "developer" | "user" | "assistant" | "tool",
        "content": str}, ...] (or rl.chat_format.Message objects).
      max_new_tokens, temperature, top_k, top_p, seed: as for `generate`.
      stop: strings that end the reply.

    Raises:
      ValueError: a malformed message, or a conversation + max_new_tokens over max_len.
      TokenizerError: the model's tokenizer has no chat roles (the message names the
        training flags that give it them).
    """
    roles = chat_format.chat_ids(self.tokenizer)
    ids = chat_format.render(self.tokenizer, chat_messages(messages),
                             add_generation_prompt=True).ids
    max_new_tokens, sampling, stop, _ = self._generation_args(
        max_new_tokens, temperature, top_k, top_p, stop, ())
    self.engine.check_fits(len(ids), max_new_tokens, "messages")
    ends = (roles["end_turn"], int(self.tokenizer.eos_id))
    out = self.engine.generate(ids[None], max_new_tokens=max_new_tokens, sampling=sampling,
                               stop_tokens=ends, seed=seed, pad_id=self.tokenizer.pad_id)
    special, shown = set(self.tokenizer.special_ids.values()), []
    for t in out.tokens[0, :out.lengths[0]].tolist():
      if t == roles["tool_call"] or t in ends:
        break
      if t not in special:
        shown.append(t)
    return stream_text(self.tokenizer, shown, stop)


# --------------------------------------------------------------------------------- loading
def _resolve_mesh(mesh) -> Mesh | None:
  """None, "auto", {axis: size} or a Mesh -> a Mesh over MESH_AXES (None: one device)."""
  if mesh is None:
    return None
  if isinstance(mesh, str):
    if mesh != "auto":
      raise ValueError(f"load: mesh={mesh!r} is invalid: allowed None (one device), "
                       f"\"auto\", a {{axis: size}} dict over {MESH_AXES} or a jax Mesh")
    return build_mesh({"fsdp": -1})
  if isinstance(mesh, Mapping):
    return build_mesh(dict(mesh))
  if isinstance(mesh, Mesh):
    unknown = sorted(set(mesh.axis_names) - set(MESH_AXES))
    if unknown:
      raise ValueError(f"load: the mesh's axes {unknown} are unknown: allowed names "
                       f"{MESH_AXES} (the sharding rules place parameters on those)")
    return mesh
  raise ValueError(f"load: mesh of type {type(mesh).__name__} is invalid: allowed None, "
                   f"\"auto\", a {{axis: size}} dict over {MESH_AXES} or a jax Mesh")


def _with_dtype(model: HybridLM, dtype: str) -> HybridLM:
  """The same parameters computing in `dtype` (parameters stay float32; only the
  activations and matmuls change, as `compute.dtype` does in training)."""
  compute = dataclasses.replace(model.compute, dtype=dtype)
  abstract = nnx.eval_shape(lambda: HybridLM(model.cfg, compute=compute, rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(abstract)
  _, state = nnx.split(model)
  return nnx.merge(graphdef, state)


def _place(model: HybridLM, mesh: Mesh) -> HybridLM:
  """Every parameter and routing bias moved onto `mesh` by the project's sharding rules."""
  if jax.process_count() > 1:
    raise NotImplementedError(
        f"load(mesh=...) on {jax.process_count()} processes: the weights are read on each "
        "host and placed from there, which needs every device of the mesh addressable "
        "(one process, e.g. a single TPU VM)")
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, tree_shardings(state, mesh, serving=True))
  return nnx.merge(graphdef, state)


def load(path: str, *, mesh=None, dtype: str | None = None, max_len: int = 2048,
         prefill_chunk: int = 256, kv_block: int = 512) -> LoadedModel:
  """Load a trained model for notebooks and scripts.

  Args:
    path: a training workdir, a params export or a converted Hugging Face dir, local or
      gs:// (see the module docstring; the kind is detected from the files).
    mesh: None (the default device), "auto" (all devices on `fsdp`), a {axis: size} dict or
      a jax.sharding.Mesh with axes among MESH_AXES.
    dtype: compute dtype ("float32", "bfloat16"); None keeps the stored one.
    max_len: decode-cache capacity N in tokens (prompt + generated, or a scored text).
    prefill_chunk: tokens per prefill step (bounds prefill memory).
    kv_block: keys per block of the cached MLA attention.

  Returns:
    A LoadedModel; `.info` holds the loader's details (source, step, skipped checkpoints).

  Raises:
    FileNotFoundError / ValueError: a missing path, an unknown layout, a bad argument (one
      line each, before anything is read); the loaders' own errors (no checkpoint, a config
      that does not match the arrays).
  """
  path = os.fspath(path)
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"load: dtype={dtype!r} is invalid: allowed None or one of {DTYPES}")
  for name, v in (("max_len", max_len), ("prefill_chunk", prefill_chunk),
                  ("kv_block", kv_block)):
    require_count(v, name, "load: ")
  path = loading.local_dir(path)   # a gs:// run or export: its local mirror
  loading.detect_layout(path)      # a bad path is reported before a bad mesh
  mesh = _resolve_mesh(mesh)
  model, tokenizer, info = loading.load(path)
  if dtype is not None and dtype != model.compute.dtype:
    model = _with_dtype(model, dtype)
  if mesh is not None:
    model = _place(model, mesh)
  return LoadedModel(model, tokenizer, info, mesh=mesh, max_len=max_len,
                     prefill_chunk=prefill_chunk, kv_block=kv_block)
