"""Prefill, decode and generate for `HybridLM` over a fixed-size cache (no per-token compiles).

Conventions: B batch, T prompt tokens, P prefill chunk, V vocab, N = max_len (cache
capacity). Every step is the model's own forward with a `DecodeCache` (`HybridLM.__call__`
with cache=...): this module only chunks, jits and samples. Every jitted function takes the
model as (graphdef, state): graphdef is static, so one compilation serves every call with the
same shapes. A prompt is fed in chunks of P tokens (the last one padded, the padding marked
by segment id 0), so its length never changes a shape and a prompt of any length up to N runs
in memory bounded by P, the cache and one attention block. The prompts of one call share one
length; the cache itself keeps a length per row.

Images (vision models): `prefill(tokens, images=...)` takes the image keys of a processed
batch (images, image_grid, image_index; see hybridmoe_jax.data.multimodal). The input
embeddings of the whole prompt are computed once (`_embed_inputs`: the vision tower runs
once per image) and then fed chunk by chunk as `inputs_embeds`: the caches hold image
positions exactly as they hold text positions, so decoding after an image needs nothing
special.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridmoe_jax.infer.sampling import SamplingConfig, sample
from hybridmoe_jax.model.cache import DecodeCache, init_cache
from hybridmoe_jax.model.decoder import HybridLM

_TRACES: collections.Counter = collections.Counter()


def trace_counts() -> dict[str, int]:
  """Traces (= compilations) so far of each jitted entry point: "prefill_chunk",
  "score_chunk", "decode_step", "generate", "embed_inputs" (for tests and benchmarks)."""
  return dict(_TRACES)


def _forward(model: HybridLM, tokens, embeds, cache: DecodeCache, n_valid: jax.Array,
             kv_block: int, logits_at: jax.Array | None = None
             ) -> tuple[jax.Array, DecodeCache]:
  """The model over one chunk [B, P] (tokens, or input embeddings [B, P, d]) whose first
  n_valid [B] tokens per row are real -> (logits [B, P or K, V] fp32, updated cache)."""
  p = (tokens if embeds is None else embeds).shape[1]
  real = (jnp.arange(p)[None, :] < n_valid[:, None]).astype(jnp.int32)
  logits, aux = model(tokens, segment_ids=real, cache=cache, inputs_embeds=embeds,
                      logits_at=logits_at, kv_block=kv_block)
  return logits, aux["cache"]


@functools.partial(jax.jit, static_argnames=("graphdef", "kv_block"), donate_argnames=("cache",))
def _prefill_chunk(graphdef, state, tokens, embeds, cache, n_valid, kv_block):
  """tokens [B, P] or embeds [B, P, d] -> (logits [B, V] at each row's last real token, cache)."""
  _TRACES["prefill_chunk"] += 1
  model = nnx.merge(graphdef, state)
  last = jnp.maximum(n_valid - 1, 0)[:, None]
  logits, cache = _forward(model, tokens, embeds, cache, n_valid, kv_block, logits_at=last)
  return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed_inputs(graphdef, state, tokens, images, image_grid, image_index):
  """tokens [B, T] + image keys -> input embeddings [B, T, d] (the tower runs once)."""
  _TRACES["embed_inputs"] += 1
  model = nnx.merge(graphdef, state)
  return model.embed_inputs(tokens, images, image_grid, image_index)


@functools.partial(jax.jit, static_argnames=("graphdef", "kv_block"), donate_argnames=("cache",))
def _score_chunk(graphdef, state, tokens, targets, cache, n_valid, kv_block):
  """-> (nll [B, P] float32 of `targets`, argmax prediction [B, P] int32, cache)."""
  _TRACES["score_chunk"] += 1
  model = nnx.merge(graphdef, state)
  logits, cache = _forward(model, tokens, None, cache, n_valid, kv_block)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = jax.nn.logsumexp(logits, axis=-1) - picked
  return nll, jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def _one_token(model: HybridLM, token: jax.Array, cache: DecodeCache, kv_block: int
               ) -> tuple[jax.Array, DecodeCache]:
  """token [B] -> (logits [B, V], cache)."""
  logits, cache = _forward(model, token[:, None], None, cache,
                           jnp.ones(token.shape, jnp.int32), kv_block)
  return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "kv_block"), donate_argnames=("cache",))
def _decode_step(graphdef, state, token, cache, kv_block):
  """token [B] int32 -> (logits [B, V] float32, cache)."""
  _TRACES["decode_step"] += 1
  return _one_token(nnx.merge(graphdef, state), token, cache, kv_block)


@functools.partial(jax.jit, static_argnames=("graphdef", "kv_block", "max_new"),
                   donate_argnames=("cache",))
def _generate_loop(graphdef, state, logits, cache, key, stop, n_new, sampling, pad_id,
                   kv_block, max_new):
  """Sample up to n_new (<= max_new) tokens in one while_loop; rows stop at a stop token."""
  _TRACES["generate"] += 1
  model = nnx.merge(graphdef, state)
  temperature, top_k, top_p, vocab_limit = sampling
  key, sub = jax.random.split(key)
  tok = sample(logits, sub, temperature, top_k, top_p, vocab_limit)
  b = tok.shape[0]
  out = jnp.full((b, max_new), pad_id, jnp.int32).at[:, 0].set(tok)
  lengths = jnp.ones((b,), jnp.int32)
  done = jnp.isin(tok, stop)

  def cond(carry):
    i, _, _, _, done, _, _ = carry
    return (i < n_new) & ~jnp.all(done)

  def body(carry):
    i, tok, out, lengths, done, cache, key = carry
    logits, cache = _one_token(model, tok, cache, kv_block)
    key, sub = jax.random.split(key)
    nxt = sample(logits, sub, temperature, top_k, top_p, vocab_limit)
    nxt = jnp.where(done, pad_id, nxt)
    out = jax.lax.dynamic_update_index_in_dim(out, nxt, i, axis=1)
    lengths = lengths + (~done).astype(jnp.int32)
    return i + 1, nxt, out, lengths, done | jnp.isin(nxt, stop), cache, key

  carry = (jnp.int32(1), tok, out, lengths, done, cache, key)
  _, _, out, lengths, _, cache, _ = jax.lax.while_loop(cond, body, carry)
  return out, lengths, cache


class GenerateOutput(NamedTuple):
  tokens: np.ndarray    # [B, max_new_tokens] int32, pad_id after a row's end
  lengths: np.ndarray   # [B] int32 generated tokens per row (a stop token included)
  cache: DecodeCache    # cache after the prompt and all but the last generated token


class Engine:
  """One model's jitted prefill / decode / generate / score over a fixed-size cache.

  Args:
    model: a HybridLM (its current parameters and routing biases are captured).
    max_len: cache capacity N in tokens (prompt + generated).
    prefill_chunk: P, tokens per prefill step (bounds prefill memory).
    kv_block: keys per block of the MLA decode attention.
  """

  def __init__(self, model: HybridLM, *, max_len: int, prefill_chunk: int = 256,
               kv_block: int = 512):
    for name, v in (("max_len", max_len), ("prefill_chunk", prefill_chunk),
                    ("kv_block", kv_block)):
      if not (isinstance(v, (int, np.integer)) and v >= 1):
        raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    self.cfg = model.cfg
    self.dtype = model.compute.dtype
    self.graphdef, self.state = nnx.split(model)
    self.max_len, self.prefill_chunk, self.kv_block = int(max_len), int(prefill_chunk), int(
        kv_block)

  def init_cache(self, batch: int) -> DecodeCache:
    return init_cache(self.cfg, batch, self.max_len, dtype=self.dtype)

  def _check_tokens(self, tokens, cache: DecodeCache | None, what: str) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
      tokens = tokens[None]
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"{what} must be integer token ids [B, T] or [T], got shape "
                       f"{tokens.shape} dtype {tokens.dtype}")
    if tokens.shape[1] == 0:
      raise ValueError(f"{what} is empty: give at least one token (e.g. BOS)")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
      raise ValueError(f"{what} holds token ids outside the vocabulary [0, "
                       f"{self.cfg.vocab_size})")
    used = 0 if cache is None else int(np.max(cache.length))
    if used + tokens.shape[1] > self.max_len:
      raise ValueError(f"{what} of {tokens.shape[1]} tokens does not fit: {used} cached + "
                       f"{tokens.shape[1]} > max_len={self.max_len} (raise max_len)")
    if cache is not None and cache.batch != tokens.shape[0]:
      raise ValueError(f"{what} has batch {tokens.shape[0]} but the cache has {cache.batch}")
    return tokens.astype(np.int32)

  def _chunks(self, tokens: np.ndarray):
    """-> (start s, chunk [B, P] zero-padded, real tokens n, n_valid [B] int32 = n per row)."""
    p = self.prefill_chunk
    for s in range(0, tokens.shape[1], p):
      part = tokens[:, s:s + p]
      n = part.shape[1]
      yield s, np.pad(part, ((0, 0), (0, p - n))), n, np.full((tokens.shape[0],), n, np.int32)

  def _image_inputs(self, tokens: np.ndarray, images: dict) -> jax.Array:
    """Input embeddings [B, T_pad, d] of a prompt with images, T padded to a multiple of P
    (so prompts of different lengths share compilations)."""
    if not self.cfg.vision.enabled:
      raise ValueError("images were given to a model without a vision tower "
                       "(model.vision.enabled = False)")
    missing = [k for k in ("images", "image_grid", "image_index") if k not in images]
    if missing:
      raise ValueError(f"images must hold images, image_grid and image_index; missing "
                       f"{missing} (build them with hybridmoe_jax.data.multimodal)")
    index = np.asarray(images["image_index"], np.int32)
    if index.shape != tokens.shape:
      raise ValueError(f"image_index has shape {index.shape}, the prompt {tokens.shape}")
    grid = np.asarray(images["image_grid"])
    pix = np.asarray(images["images"], np.float32)
    slots = grid.shape[1]
    k = (pix.shape[2] // (2 * self.cfg.vision.patch_size)) ** 2
    if index.max(initial=-1) >= slots * k:
      raise ValueError(f"image_index refers to image token {int(index.max())} but the "
                       f"images provide {slots * k}")
    pad = -tokens.shape[1] % self.prefill_chunk
    tokens = np.pad(tokens, ((0, 0), (0, pad)))
    index = np.pad(index, ((0, 0), (0, pad)), constant_values=-1)
    return _embed_inputs(self.graphdef, self.state, jnp.asarray(tokens), jnp.asarray(pix),
                         jnp.asarray(grid, jnp.int32), jnp.asarray(index))

  def prefill(self, tokens, cache: DecodeCache | None = None, images: dict | None = None
              ) -> tuple[jax.Array, DecodeCache]:
    """Feed a prompt [B, T] after `cache` (if given) -> (last token's logits [B, V], cache).

    images: optional image keys of the prompt (see the module docstring).
    The cache passed in is donated (its buffers are reused): use only the returned one.
    """
    tokens = self._check_tokens(tokens, cache, "prompt")
    cache = self.init_cache(tokens.shape[0]) if cache is None else cache
    if images is not None:
      x = self._image_inputs(tokens, images)
      p = self.prefill_chunk
      for s, _, _, n_valid in self._chunks(tokens):
        logits, cache = _prefill_chunk(self.graphdef, self.state, None, x[:, s:s + p], cache,
                                       n_valid, kv_block=self.kv_block)
      return logits, cache
    for _, part, _, n_valid in self._chunks(tokens):
      logits, cache = _prefill_chunk(self.graphdef, self.state, part, None, cache, n_valid,
                                     kv_block=self.kv_block)
    return logits, cache

  def decode_step(self, token, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
    """Feed one token per row, token [B] int -> (logits [B, V] float32, cache); the cache
    passed in is donated."""
    if int(np.max(cache.length)) >= self.max_len:
      raise ValueError(f"the cache is full (max_len={self.max_len})")
    return _decode_step(self.graphdef, self.state, jnp.asarray(token, jnp.int32), cache,
                        kv_block=self.kv_block)

  def score(self, tokens) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced scoring of [B, T] in chunks -> (nll [B, T-1] of tokens[:, 1:],
    argmax predictions [B, T-1]); position t predicts token t + 1."""
    tokens = self._check_tokens(tokens, None, "text")
    targets = np.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    cache, nll, pred = self.init_cache(tokens.shape[0]), [], []
    for s, part, n, n_valid in self._chunks(tokens):
      tgt = np.pad(targets[:, s:s + n], ((0, 0), (0, part.shape[1] - n)))
      a, b, cache = _score_chunk(self.graphdef, self.state, part, tgt, cache, n_valid,
                                 kv_block=self.kv_block)
      nll.append(np.asarray(a)[:, :n])
      pred.append(np.asarray(b)[:, :n])
    return np.concatenate(nll, 1)[:, :-1], np.concatenate(pred, 1)[:, :-1]

  def generate(self, prompt, *, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
               stop_tokens: Sequence[int] = (), seed: int = 0, pad_id: int = 0,
               images: dict | None = None) -> GenerateOutput:
    """Prefill `prompt` [B, T] (with `images`, if given: see prefill), then sample up to
    max_new_tokens (fewer if the cache fills or every row hit a stop token). One
    compilation per (B, max_new_tokens)."""
    if not (isinstance(max_new_tokens, (int, np.integer)) and max_new_tokens >= 1):
      raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not 0 <= pad_id < self.cfg.vocab_size:   # finished rows are fed pad_id
      raise ValueError(f"pad_id={pad_id} is outside the vocabulary [0, {self.cfg.vocab_size})")
    tokens = self._check_tokens(prompt, None, "prompt")
    room = self.max_len - tokens.shape[1]
    if room < 1:
      raise ValueError(f"prompt of {tokens.shape[1]} tokens leaves no room to generate "
                       f"within max_len={self.max_len}")
    logits, cache = self.prefill(tokens, images=images)
    # A fixed-size stop list (padded with -1) keeps one compilation for any stop set.
    stop = list(stop_tokens)
    stop = jnp.asarray(stop + [-1] * (max(8, len(stop)) - len(stop)), jnp.int32)
    out, lengths, cache = _generate_loop(
        self.graphdef, self.state, logits, cache, jax.random.PRNGKey(seed), stop,
        jnp.int32(min(max_new_tokens, room)), sampling.as_arrays(), jnp.int32(pad_id),
        kv_block=self.kv_block, max_new=int(max_new_tokens))
    return GenerateOutput(np.asarray(out), np.asarray(lengths), cache)


def prefill(model: HybridLM, tokens, *, max_len: int, chunk_size: int = 256,
            kv_block: int = 512, cache: DecodeCache | None = None
            ) -> tuple[jax.Array, DecodeCache]:
  """Functional `Engine.prefill`: tokens [B, T] -> (logits [B, V], cache of capacity max_len).

  Compilations are shared across calls with the same shapes (the graphdef is static).
  """
  engine = Engine(model, max_len=max_len, prefill_chunk=chunk_size, kv_block=kv_block)
  return engine.prefill(tokens, cache)


def decode_step(model: HybridLM, token, cache: DecodeCache, *, kv_block: int = 512
                ) -> tuple[jax.Array, DecodeCache]:
  """Functional `Engine.decode_step`: token [B] -> (logits [B, V], cache); capacity = cache's."""
  return Engine(model, max_len=cache.max_len, kv_block=kv_block).decode_step(token, cache)


def generate(model: HybridLM, prompt, *, max_new_tokens: int, max_len: int | None = None,
             sampling: SamplingConfig = SamplingConfig(), stop_tokens: Sequence[int] = (),
             seed: int = 0, chunk_size: int = 256, kv_block: int = 512,
             pad_id: int = 0) -> GenerateOutput:
  """Functional `Engine.generate`; max_len defaults to prompt + max_new_tokens."""
  t = np.asarray(prompt).shape[-1]
  engine = Engine(model, max_len=max_len or t + max_new_tokens, prefill_chunk=chunk_size,
                  kv_block=kv_block)
  return engine.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                         stop_tokens=stop_tokens, seed=seed, pad_id=pad_id)
