"""A Python API for notebooks: `load(path)` -> a `LoadedModel` with generate, score, forward.

`load` reads any of three layouts, recognised from the files in `path`:
  training workdir   model_config.json + checkpoints/   the newest good checkpoint, read-only
                                                        (`evals.loading.load_from_workdir`)
  params export      model_config.json + params/        (`evals.loading.load_from_params`)
  Hugging Face dir   config.json + *.safetensors        (`hybridmoe_jax.convert.load_hf_model`)
and returns a `LoadedModel`: the HybridLM, its ModelConfig, the tokenizer and the loader's
info, with text-in / text-out calls on top of `infer.Engine` (chunked prefill, cached decode,
one compilation per shape).

Conventions: B texts / prompts, T tokens, V vocabulary, N = max_len (the decode cache's
capacity, fixed per LoadedModel so that every call with the same batch size reuses one
compilation). Texts are encoded with BOS first (as training documents are); generation stops
at EOS by default.

Ragged batches: the engine's prompts of one call share one length, so `generate` and `score`
run one engine call per distinct token length (rows keep their order); `forward` right-pads
with the pad id marked as padding (segment id 0), which the model excludes exactly.

Sharding (`mesh=`): None keeps the model on the default device; "auto" (every device on the
`fsdp` axis), a {axis: size} dict (see `parallel.mesh.build_mesh`) or a `jax.sharding.Mesh`
places every parameter with the project's rules (`parallel.rules.tree_shardings`), and XLA
partitions the engine's jitted steps from those placements: the same call runs on one CPU or
a TPU VM. The weights are read whole, then placed, so they must fit in host memory, and the
mesh must be one process's devices.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import math
import os
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybridmoe_jax.config import DTYPES, ModelConfig
from hybridmoe_jax.convert import load_hf_model
from hybridmoe_jax.data.tokenizer import TOKENIZER_DIR, check_vocab, tokenizer_from_dir
from hybridmoe_jax.evals.loading import load_from_params, load_from_workdir
from hybridmoe_jax.infer import Engine, SamplingConfig, init_cache
from hybridmoe_jax.infer.streaming import TextStream, stream_text
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.model.cache import cache_bytes, mla_bytes_per_token
from hybridmoe_jax.parallel.mesh import build_mesh
from hybridmoe_jax.parallel.rules import tree_shardings
from hybridmoe_jax.sharding import MESH_AXES
from hybridmoe_jax.train.checkpoint import CONFIG_FILE
from hybridmoe_jax.train.params_export import PARAMS_FILE

_LAYOUTS = (f"a training workdir ({CONFIG_FILE} + checkpoints/), a params export "
            f"({CONFIG_FILE} + {PARAMS_FILE}, or params/ from older versions) or a Hugging "
            "Face dir (config.json + *.safetensors)")


# --------------------------------------------------------------------------------- loading
def detect_layout(path: str) -> str:
  """"workdir", "params" or "hf", from the files in `path`.

  Raises:
    FileNotFoundError: `path` does not exist. ValueError: it is none of the three layouts
      (the message lists what each needs).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"load: path {path} does not exist (expected {_LAYOUTS})")
  if not os.path.isdir(path):
    raise ValueError(f"load: path {path} is a file, not a directory (expected {_LAYOUTS})")
  has = lambda name: os.path.exists(os.path.join(path, name))  # noqa: E731
  if has(CONFIG_FILE) and (has(PARAMS_FILE) or os.path.isdir(os.path.join(path, "params"))):
    return "params"
  if has(CONFIG_FILE) and os.path.isdir(os.path.join(path, "checkpoints")):
    return "workdir"
  if has("config.json") and glob.glob(os.path.join(path, "*.safetensors")):
    return "hf"
  present = sorted(os.listdir(path))[:8]
  raise ValueError(f"load: {path} holds none of the known layouts: expected {_LAYOUTS}; "
                   f"found {present or 'an empty directory'}")



def _tokenizer_for(path: str, kind: str, cfg: ModelConfig):
  """The tokenizer stored with the model: `<path>/tokenizer/` of a run or export, the top of
  an HF dir; the byte tokenizer when there is none (with the image ids when the model has a
  vision tower).

  Raises:
    TokenizerError: a stored tokenizer file cannot be read. ValueError: its ids do not fit
      the model's embedding.
  """
  where = path if kind == "hf" else os.path.join(path, TOKENIZER_DIR)
  tokenizer = tokenizer_from_dir(where, vision=cfg.vision.enabled)
  check_vocab(tokenizer, cfg.vocab_size)
  return tokenizer


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
  state = jax.device_put(state, tree_shardings(state, mesh))
  return nnx.merge(graphdef, state)


def load(path: str, *, mesh=None, dtype: str | None = None, max_len: int = 2048,
         prefill_chunk: int = 256, kv_block: int = 512) -> "LoadedModel":
  """Load a trained model for notebooks and scripts.

  Args:
    path: a training workdir, a params export or a converted Hugging Face dir (see the
      module docstring; the kind is detected from the files).
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
    if not (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1):
      raise ValueError(f"load: {name}={v!r} is invalid: allowed an integer >= 1")
  layout = detect_layout(path)
  mesh = _resolve_mesh(mesh)
  if layout == "workdir":
    model, info = load_from_workdir(path)
  elif layout == "params":
    model, info = load_from_params(path)
  else:
    model, info = load_hf_model(path)
  tokenizer = _tokenizer_for(path, layout, model.cfg)
  if dtype is not None and dtype != model.compute.dtype:
    model = _with_dtype(model, dtype)
  if mesh is not None:
    model = _place(model, mesh)
  return LoadedModel(model, tokenizer, dict(info, layout=layout), mesh=mesh, max_len=max_len,
                     prefill_chunk=prefill_chunk, kv_block=kv_block)


# ------------------------------------------------------------------------------ the model
@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits(graphdef, state, tokens, segment_ids):
  """tokens, segment_ids [B, T] int32 -> logits [B, T, V] float32 (the training forward)."""
  return nnx.merge(graphdef, state)(tokens, segment_ids=segment_ids)[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "kv_block"), donate_argnames=("cache",))
def _logits_and_cache(graphdef, state, tokens, segment_ids, cache, kv_block):
  """The cached forward over [B, T] (real tokens a prefix of each row) -> (logits, cache)."""
  logits, aux = nnx.merge(graphdef, state)(tokens, segment_ids=segment_ids, cache=cache,
                                           kv_block=kv_block)
  return logits, aux["cache"]


@dataclasses.dataclass(frozen=True)
class TextScore:
  """Teacher-forced score of one text: token t + 1 predicted from tokens 0..t.

  tokens: int32 [T] the encoded text (BOS first); logprobs: float32 [T - 1] the log-prob
  of tokens[1:]; nll: their summed negative log-likelihood (nats); perplexity:
  exp(nll / (T - 1)); num_bytes: UTF-8 bytes of the scored text; bits_per_byte:
  nll / ln 2 / num_bytes (the training eval's measure, comparable across tokenizers).
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  nll: float
  perplexity: float
  num_bytes: int
  bits_per_byte: float

  def __repr__(self) -> str:
    return (f"TextScore(tokens={len(self.tokens)}, nll={self.nll:.4f}, perplexity="
            f"{self.perplexity:.4f}, bits_per_byte={self.bits_per_byte:.4f})")


class LoadedModel:
  """A model ready for generate / score / forward (see the module docstring).

  Attributes:
    model: the HybridLM (parameters and routing biases; on the mesh if one was given).
    config: its ModelConfig.
    tokenizer: encodes / decodes text (`encode(text, bos=, eos=)`, `decode(ids)`).
    info: what the loader reports (layout, path, checkpoint step, ...).
    mesh: the Mesh the parameters live on, or None.
    max_len: the decode cache's capacity N.
  """

  def __init__(self, model: HybridLM, tokenizer, info: dict[str, Any], *,
               mesh: Mesh | None = None, max_len: int = 2048, prefill_chunk: int = 256,
               kv_block: int = 512):
    self.model, self.tokenizer, self.info, self.mesh = model, tokenizer, info, mesh
    self.config: ModelConfig = model.cfg
    self.max_len = int(max_len)
    self.engine = Engine(model, max_len=self.max_len, prefill_chunk=prefill_chunk,
                         kv_block=kv_block)

  def __repr__(self) -> str:
    kinds = ",".join(self.config.layer_kinds)
    where = f"mesh {dict(self.mesh.shape)}" if self.mesh is not None else "one device"
    return (f"LoadedModel({self.info.get('layout')} {self.info.get('path')}, step "
            f"{self.info.get('step', '-')}, layers [{kinds}], vocab {self.config.vocab_size}, "
            f"{self.model.compute.dtype}, {where}, max_len {self.max_len})")

  # ---------------------------------------------------------------------------- inputs
  def _as_rows(self, inputs, what: str, *, bos: bool, eos: bool = False
               ) -> tuple[list[np.ndarray], bool, list]:
    """str / ids [T] / list of either / ids [B, T] -> (int32 rows, whether one was given,
    the inputs one per row).

    Raises:
      ValueError: no input, an empty text or row, non-integer ids or ids outside
        [0, vocab_size) (naming the row).
    """
    if isinstance(inputs, str):
      items, single = [inputs], True
    elif isinstance(inputs, (np.ndarray, jax.Array)):
      if inputs.ndim not in (1, 2):
        raise ValueError(f"{what} must be a str, token ids [T] or [B, T], or a list of "
                         f"those; got an array of shape {inputs.shape}")
      items, single = ([inputs] if inputs.ndim == 1 else list(inputs)), inputs.ndim == 1
    elif isinstance(inputs, (list, tuple)):
      single = bool(inputs) and all(isinstance(x, (int, np.integer)) for x in inputs)
      items = [inputs] if single else list(inputs)
    else:
      raise ValueError(f"{what} must be a str, token ids [T] or [B, T], or a list of those; "
                       f"got {type(inputs).__name__}")
    if not items:
      raise ValueError(f"{what} is an empty list: give at least one text or token-id list")
    rows = []
    for i, item in enumerate(items):
      name = what if single else f"{what}[{i}]"
      if isinstance(item, str):
        if not item:
          raise ValueError(f"{name} is an empty string: give some text (or token ids such "
                           "as [tokenizer.bos_id])")
        rows.append(np.asarray(self.tokenizer.encode(item, bos=bos, eos=eos), np.int32))
        continue
      ids = np.asarray(item)
      if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{name} must be a str or integer token ids [T], got shape "
                         f"{ids.shape} dtype {ids.dtype}")
      if ids.size == 0:
        raise ValueError(f"{name} is empty: give at least one token id")
      if ids.min() < 0 or ids.max() >= self.config.vocab_size:
        bad = int(ids[(ids < 0) | (ids >= self.config.vocab_size)][0])
        raise ValueError(f"{name} holds token id {bad}, outside the vocabulary "
                         f"[0, {self.config.vocab_size})")
      rows.append(ids.astype(np.int32))
    return rows, single, items

  def _check_fits(self, rows: Sequence[np.ndarray], extra: int, what: str) -> None:
    longest = max(len(r) for r in rows)
    if longest + extra > self.max_len:
      more = f" + {extra} new tokens" if extra else ""
      raise ValueError(f"{what}: {longest} tokens{more} exceed the cache capacity max_len="
                       f"{self.max_len}; load with a larger max_len (load(path, max_len=...))")

  @staticmethod
  def _groups(rows: Sequence[np.ndarray]) -> list[list[int]]:
    """Row indices grouped by length (the engine's prompts of one call share a length)."""
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
      by_len.setdefault(len(r), []).append(i)
    return list(by_len.values())

  # ------------------------------------------------------------------------------ calls
  def generate(self, prompts, *, max_new_tokens: int = 64, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               stop: str | Sequence[str] = (), stop_tokens: Sequence[int] | None = None
               ) -> str | list[str]:
    """Continue one prompt or a list of prompts (any lengths).

    Args:
      prompts: a str, a list of str, token ids [T] or [B, T], or a list of id lists; text is
        encoded with BOS first.
      max_new_tokens: tokens to sample per prompt (fewer if a stop token comes first);
        prompt + max_new_tokens must fit max_len.
      temperature, top_k, top_p: sampling (temperature 0: greedy; top_k 0 / top_p 1: off).
      seed: the sampling key (prompts of one length share one engine call and key).
      stop: strings that end a continuation: the text is cut before the first one.
      stop_tokens: ids that end a row's generation (default: the tokenizer's EOS); the stop
        token itself is not decoded.

    Returns:
      The continuation (new text only): a str for one prompt, else a list in prompt order.
    """
    sampling, stop, stop_set = self._generation_args(max_new_tokens, temperature, top_k,
                                                     top_p, stop, stop_tokens)
    rows, single, _ = self._as_rows(prompts, "prompt", bos=True)
    self._check_fits(rows, int(max_new_tokens), "prompt")
    texts: list[str] = [""] * len(rows)
    for group in self._groups(rows):
      out = self.engine.generate(np.stack([rows[i] for i in group]),
                                 max_new_tokens=int(max_new_tokens), sampling=sampling,
                                 stop_tokens=tuple(stop_set), seed=seed,
                                 pad_id=self.tokenizer.pad_id)
      for j, i in enumerate(group):
        ids = out.tokens[j, :out.lengths[j]]
        if len(ids) and int(ids[-1]) in stop_set:
          ids = ids[:-1]
        texts[i] = stream_text(self.tokenizer, ids, stop)
    return texts[0] if single else texts

  def generate_stream(self, prompt, *, max_new_tokens: int = 64, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                      stop: str | Sequence[str] = (), stop_tokens: Sequence[int] | None = None,
                      bos: bool = True) -> Iterator[str]:
    """Token streaming: yield the continuation of ONE prompt as text pieces, as they are
    generated (`infer.Engine.generate_stream` + `infer.streaming.TextStream`).

    Same arguments as `generate` for one prompt (bos: encode text with BOS first); the
    pieces joined equal `generate(prompt, ...)` with the same seed. A stop string ends the
    stream (cut before it); a stop token ends it and is not shown.
    """
    sampling, stop, stop_set = self._generation_args(max_new_tokens, temperature, top_k,
                                                     top_p, stop, stop_tokens)
    rows, single, _ = self._as_rows(prompt, "prompt", bos=bos)
    if not single:
      raise ValueError(f"generate_stream takes one prompt (a str or token ids [T]), got "
                       f"{len(rows)}; use generate for a batch")
    self._check_fits(rows, int(max_new_tokens), "prompt")
    text = TextStream(self.tokenizer, stop)
    for tok in self.engine.generate_stream(rows[0], max_new_tokens=int(max_new_tokens),
                                           sampling=sampling, stop_tokens=tuple(stop_set),
                                           seed=seed):
      if tok in stop_set:
        break
      piece = text.push(tok)
      if piece:
        yield piece
      if text.stopped:
        return
    piece = text.finish()
    if piece:
      yield piece

  def _generation_args(self, max_new_tokens, temperature, top_k, top_p, stop, stop_tokens
                       ) -> tuple[SamplingConfig, tuple[str, ...], set[int]]:
    """Checked generation arguments -> (SamplingConfig, stop strings, stop ids)."""
    if not (isinstance(max_new_tokens, (int, np.integer)) and not isinstance(
        max_new_tokens, bool) and max_new_tokens >= 1):
      raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: allowed an integer "
                       f">= 1")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              vocab_limit=self.tokenizer.vocab_size)
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if stop_tokens is None:
      stop_tokens = (self.tokenizer.eos_id,)
    return sampling, stop, set(int(s) for s in stop_tokens)

  def score(self, texts, *, bos: bool = True, eos: bool = False
            ) -> TextScore | list[TextScore]:
    """Teacher-forced log-probs of every token after the first, per text.

    Args:
      texts: a str, a list of str (any lengths), or token ids (as for generate).
      bos, eos: how text is encoded (BOS first, so the first character is scored too; eos
        adds the end-of-text prediction, as the training eval does).

    Returns:
      A TextScore for one text, else a list in input order.
    """
    rows, single, items = self._as_rows(texts, "text", bos=bos, eos=eos)
    for i, r in enumerate(rows):
      if len(r) < 2:
        raise ValueError(f"text{'' if single else f'[{i}]'} has {len(r)} token: scoring "
                         "needs at least 2 (the first one is only context)")
    self._check_fits(rows, 0, "text")
    out: list[TextScore | None] = [None] * len(rows)
    for group in self._groups(rows):
      nll, _ = self.engine.score(np.stack([rows[i] for i in group]))
      for j, i in enumerate(group):
        row_nll = nll[j].astype(np.float32)
        total = float(row_nll.astype(np.float64).sum())
        item = items[i]
        num_bytes = (len(item.encode("utf-8")) if isinstance(item, str)
                     else self._num_bytes(rows[i][1:]))
        out[i] = TextScore(tokens=rows[i], logprobs=-row_nll, nll=total,
                           perplexity=math.exp(total / len(row_nll)), num_bytes=num_bytes,
                           bits_per_byte=total / math.log(2) / max(num_bytes, 1))
    return out[0] if single else out

  def _num_bytes(self, ids: np.ndarray) -> int:
    """UTF-8 bytes that token ids stand for, by the tokenizer's `token_bytes` (what
    bits/byte counts in training). Ids past the tokenizer's vocabulary (a model whose
    embedding is larger, e.g. an HF dir without tokenizer files read with the byte
    tokenizer) stand for no text: 0 bytes, never a decode error."""
    per_id = self.tokenizer.token_bytes()
    ids = np.asarray(ids)
    return int(per_id[ids[ids < len(per_id)]].sum())

  def forward(self, inputs, *, bos: bool = True, return_cache: bool = False):
    """The model's logits at every position.

    Args:
      inputs: a str, token ids [T] or [B, T], or a list of texts / id lists (any lengths:
        right-padded with the pad id, marked as padding, so padded positions change
        nothing; their logits are meaningless).
      bos: prepend BOS to text inputs.
      return_cache: also return the DecodeCache (capacity max_len) holding the inputs, to
        continue with `self.engine.decode_step`.

    Returns:
      logits float32 [B, T, V] (B = 1 for a single input), or (logits, cache).
    """
    rows, _, _ = self._as_rows(inputs, "inputs", bos=bos)
    t = max(len(r) for r in rows)
    tokens = np.full((len(rows), t), self.tokenizer.pad_id, np.int32)
    segments = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(r)], segments[i, :len(r)] = r, 1
    graphdef, state = self.engine.graphdef, self.engine.state
    if not return_cache:
      return _logits(graphdef, state, jnp.asarray(tokens), jnp.asarray(segments))
    self._check_fits(rows, 0, "inputs")
    cache = self.engine.init_cache(len(rows))
    return _logits_and_cache(graphdef, state, jnp.asarray(tokens), jnp.asarray(segments),
                             cache, kv_block=self.engine.kv_block)

  def cache_bytes(self, max_len: int | None = None, batch: int = 1) -> dict[str, int]:
    """`cache_sizes` of this model in its compute dtype; max_len defaults to its capacity."""
    return cache_sizes(self.config, self.max_len if max_len is None else max_len, batch,
                       dtype=self.model.compute.dtype)


def cache_sizes(config: ModelConfig, max_len: int, batch: int = 1, *,
                dtype: str = "float32") -> dict[str, int]:
  """Bytes of a decode cache for `batch` rows of `max_len` tokens, from shapes only (nothing
  is allocated, so any model size and length can be asked).

  Returns:
    {"kda": KDA conv tails + recurrent state (constant in max_len), "mla": MLA latent cache
    (linear in max_len), "total", "mla_per_token": bytes the MLA cache adds per token of one
    row}.
  """
  for name, v in (("max_len", max_len), ("batch", batch)):
    if not (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1):
      raise ValueError(f"cache_sizes: {name}={v!r} is invalid: allowed an integer >= 1")
  shapes = jax.eval_shape(lambda: init_cache(config, int(batch), int(max_len), dtype=dtype))
  out = cache_bytes(shapes)   # ShapeDtypeStructs carry the size and dtype it reads
  out["mla_per_token"] = mla_bytes_per_token(config, dtype=dtype)
  return out
