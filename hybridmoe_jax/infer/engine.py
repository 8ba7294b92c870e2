"""Prefill, decode and generate for `HybridLM` over a fixed-size cache (no per-token compiles).

Conventions: B batch, T prompt tokens, P prefill chunk, V vocab, N = max_len (cache
capacity). Every step is the model's own forward with a `DecodeCache` (`HybridLM.__call__`
with cache=...): this module only chunks, checks and samples; the jitted steps
(infer/steps.py) take the model as (graphdef, state): graphdef is static, so one compilation
serves every call with the same shapes. A prompt is fed in chunks of P tokens (the last one
padded, the padding marked by segment id 0), so its length never changes a shape and a prompt of any length up to N runs
in memory bounded by P, the cache and one attention block. The cache keeps a length per row,
and prompts of one call may be ragged: `prefill(tokens, lengths=...)` takes rows padded on
the right to one width T with their real lengths [B]; each row's cache advances by its own
length (the padding is segment id 0, which leaves a row's cache untouched) and the logits
returned are those of each row's last real token. Without `lengths` every row is T long.

Images (vision models): `prefill(tokens, images=...)` takes the image keys of a processed
batch (images, image_grid, image_index; see hybridmoe_jax.data.multimodal). The input
embeddings of the whole prompt are computed once (`_embed_inputs`: the vision tower runs
once per image) and then fed chunk by chunk as `inputs_embeds`: the caches hold image
positions exactly as they hold text positions, so decoding after an image needs nothing
special.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridmoe_jax.config import is_int
from hybridmoe_jax.infer.sampling import SamplingConfig
from hybridmoe_jax.infer.steps import (_decode_step, _embed_inputs, _generate_loop, _logits,
                                       _prefill_chunk, _score_chunk, feed_and_draw_fn)
from hybridmoe_jax.model.cache import DecodeCache, init_cache
from hybridmoe_jax.model.decoder import HybridLM


def require_count(value, name: str, where: str = "") -> int:
  """int(value) for an integer >= 1 (bool refused), else a one-line ValueError naming
  `where` + `name`, the value and the allowed range."""
  if not (is_int(value) and value >= 1):
    raise ValueError(f"{where}{name}={value!r} is invalid: allowed an integer >= 1")
  return int(value)


def row_sampling(sampling: "SamplingConfig", batch: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(temperature float32 [B], top_k int32 [B], top_p float32 [B]) of one setting."""
  return (np.full(batch, sampling.temperature, np.float32),
          np.full(batch, sampling.top_k, np.int32), np.full(batch, sampling.top_p, np.float32))


def batch_bucket(batch: int) -> int:
  """The batch size `Engine.generate` compiles for: `batch` rounded up to a power of two."""
  return 1 << (int(batch) - 1).bit_length()


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
      require_count(v, name)
    self.cfg = model.cfg
    self.dtype = model.compute.dtype
    self.graphdef, self.state = nnx.split(model)
    self.max_len, self.prefill_chunk, self.kv_block = int(max_len), int(prefill_chunk), int(
        kv_block)

  def init_cache(self, batch: int) -> DecodeCache:
    return init_cache(self.cfg, batch, self.max_len, dtype=self.dtype)

  def check_fits(self, length: int, new_tokens: int, what: str) -> None:
    """ValueError (one line) unless `length` tokens + `new_tokens` fit the cache (max_len)."""
    if length + new_tokens > self.max_len:
      more = f" + {new_tokens} new tokens" if new_tokens else ""
      raise ValueError(f"{what}: {length} tokens{more} exceed the cache capacity max_len="
                       f"{self.max_len}: no room for them (raise max_len)")

  def _check_tokens(self, tokens, cache: DecodeCache | None, what: str, lengths=None,
                    min_length: int = 0, fit: bool = True
                    ) -> tuple[np.ndarray, np.ndarray | None]:
    """-> (tokens [B, T] int32, lengths [B] int32 in [min_length, T] or None); fit: the
    tokens must also fit the cache after what it holds."""
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
    if cache is not None and cache.batch != tokens.shape[0]:
      raise ValueError(f"{what} has batch {tokens.shape[0]} but the cache has {cache.batch}")
    b, t = tokens.shape
    if lengths is not None:
      lengths = np.asarray(lengths)
      if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"{what} lengths must be integers [B={b}], got shape "
                         f"{lengths.shape} dtype {lengths.dtype}")
      if lengths.min() < min_length or lengths.max() > t:
        raise ValueError(f"{what} lengths must lie in [{min_length}, {t}] (the padded "
                         f"width), got {lengths.tolist()}")
      lengths = lengths.astype(np.int32)
    used = np.zeros(b, np.int64) if cache is None else np.asarray(cache.length, np.int64)
    need = used + (t if lengths is None else lengths)
    if fit and need.max() > self.max_len:
      row = int(np.argmax(need))
      raise ValueError(f"{what} of {int(need[row] - used[row])} tokens does not fit: "
                       f"{int(used[row])} cached + {int(need[row] - used[row])} > "
                       f"max_len={self.max_len} (raise max_len)")
    return tokens.astype(np.int32), lengths

  def _chunks(self, tokens: np.ndarray, lengths: np.ndarray | None = None):
    """-> (start s, chunk [B, P] zero-padded, real columns n, n_valid [B] int32: the real
    tokens of each row in this chunk (n, or fewer for a row of `lengths` ending earlier))."""
    p = self.prefill_chunk
    for s in range(0, tokens.shape[1], p):
      part = tokens[:, s:s + p]
      n = part.shape[1]
      n_valid = np.full((tokens.shape[0],), n, np.int32) if lengths is None else \
          np.clip(lengths - s, 0, n).astype(np.int32)
      yield s, np.pad(part, ((0, 0), (0, p - n))), n, n_valid

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

  def prefill(self, tokens, cache: DecodeCache | None = None, images: dict | None = None,
              lengths=None) -> tuple[jax.Array, DecodeCache]:
    """Feed a prompt [B, T] after `cache` (if given) -> (last token's logits [B, V], cache).

    images: optional image keys of the prompt (see the module docstring).
    lengths: optional [B] ints in [0, T]: row b's real tokens are tokens[b, :lengths[b]] (the
      rest is padding, never cached); the logits are those of each row's last real token (of
      a row with length 0, whose cache is left as it was, they are meaningless).
    The cache passed in is donated (its buffers are reused): use only the returned one.
    """
    tokens, lengths = self._check_tokens(tokens, cache, "prompt", lengths)
    cache = self.init_cache(tokens.shape[0]) if cache is None else cache
    x = None if images is None else self._image_inputs(tokens, images)
    p, logits = self.prefill_chunk, None
    for s, part, _, n_valid in self._chunks(tokens, lengths):
      if x is None:
        new, cache = _prefill_chunk(self.graphdef, self.state, part, None, cache, n_valid,
                                    kv_block=self.kv_block)
      else:
        new, cache = _prefill_chunk(self.graphdef, self.state, None, x[:, s:s + p], cache,
                                    n_valid, kv_block=self.kv_block)
      # A ragged row keeps the logits of the chunk its prompt ended in.
      logits = new if logits is None else jnp.where(jnp.asarray(n_valid > 0)[:, None], new,
                                                    logits)
    return logits, cache

  def decode_step(self, token, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
    """Feed one token per row, token [B] int -> (logits [B, V] float32, cache); the cache
    passed in is donated."""
    if int(np.max(cache.length)) >= self.max_len:
      raise ValueError(f"the cache is full (max_len={self.max_len})")
    return _decode_step(self.graphdef, self.state, jnp.asarray(token, jnp.int32), cache,
                        kv_block=self.kv_block)

  def score(self, tokens, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced scoring of [B, T] in chunks -> (nll [B, T-1] of tokens[:, 1:],
    argmax predictions [B, T-1]); position t predicts token t + 1.

    lengths: optional [B] ints in [1, T] for ragged texts padded on the right: row b's
    entries past lengths[b] - 1 are meaningless (its padding is never fed as text)."""
    tokens, lengths = self._check_tokens(tokens, None, "text", lengths, min_length=1)
    targets = np.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    cache, nll, pred = self.init_cache(tokens.shape[0]), [], []
    for s, part, n, n_valid in self._chunks(tokens, lengths):
      tgt = np.pad(targets[:, s:s + n], ((0, 0), (0, part.shape[1] - n)))
      a, b, cache = _score_chunk(self.graphdef, self.state, part, tgt, cache, n_valid,
                                 kv_block=self.kv_block)
      nll.append(np.asarray(a)[:, :n])
      pred.append(np.asarray(b)[:, :n])
    return np.concatenate(nll, 1)[:, :-1], np.concatenate(pred, 1)[:, :-1]

  def forward(self, tokens, lengths=None, *, return_cache: bool = False):
    """The logits at every position of [B, T] in one forward (not chunked).

    lengths: optional [B] ints in [1, T] for ragged rows padded on the right (the padding
      is marked as such and changes nothing; its logits are meaningless).
    return_cache: run the cached forward instead and also return the DecodeCache (capacity
      max_len) holding the rows, to continue with `decode_step`; the rows must fit it.
    Returns: logits float32 [B, T, V], or (logits, cache).
    """
    tokens, lengths = self._check_tokens(tokens, None, "inputs", lengths, min_length=1,
                                         fit=return_cache)
    b, t = tokens.shape
    n_valid = np.full(b, t, np.int32) if lengths is None else lengths
    cache = self.init_cache(b) if return_cache else None
    logits, cache = _logits(self.graphdef, self.state, jnp.asarray(tokens), cache,
                            jnp.asarray(n_valid), kv_block=self.kv_block)
    return (logits, cache) if return_cache else logits

  def generate(self, prompt, *, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
               stop_tokens: Sequence[int] = (), seed: int = 0, pad_id: int = 0,
               images: dict | None = None, prompt_lengths=None, bucket: bool = True
               ) -> GenerateOutput:
    """Prefill `prompt` [B, T] (with `images`, if given: see prefill), then sample up to
    max_new_tokens (fewer if the cache fills or every row hit a stop token).

    What compiles: one prefill chunk and one decode loop per batch bucket (B rounded up to
    a power of two: 1, 2, 4, 8, ...; the extra rows are padding that changes nothing and is
    cut off; a batch with images compiles for its own B), and nothing per max_new_tokens
    (the loop's output buffer is max_len wide, its trip count a traced value); prompt
    lengths never compile (chunks of P). Sampling settings, seeds and stop ids are traced
    values too. A first call per bucket compiles (seconds); later calls of any
    max_new_tokens and any B in that bucket do not.

    prompt_lengths: optional [B] ints in [1, T] for ragged prompts padded on the right (see
      prefill's `lengths`); each row then continues from its own last prompt token.
    bucket: False compiles for the exact (B, max_new_tokens) instead (the reference the
      tests compare the bucketed path with; the tokens are the same).
    Returns: GenerateOutput with tokens [B, max_new_tokens].
    """
    require_count(max_new_tokens, "max_new_tokens")
    if not 0 <= pad_id < self.cfg.vocab_size:   # finished rows are fed pad_id
      raise ValueError(f"pad_id={pad_id} is outside the vocabulary [0, {self.cfg.vocab_size})")
    tokens, lengths = self._check_tokens(prompt, None, "prompt", prompt_lengths, min_length=1)
    longest = tokens.shape[1] if lengths is None else int(lengths.max())
    self.check_fits(longest, 1, "prompt")
    room = self.max_len - longest
    b = tokens.shape[0]
    # Images are embedded per row: a batch with images keeps its own size.
    rows = batch_bucket(b) if bucket and images is None else b
    if rows > b:   # padding rows: length 0 (prefill leaves their cache empty), not live
      lengths = np.full(b, tokens.shape[1], np.int32) if lengths is None else lengths
      tokens = np.pad(tokens, ((0, rows - b), (0, 0)), constant_values=pad_id)
      lengths = np.pad(lengths, (0, rows - b))
    logits, cache = self.prefill(tokens, images=images, lengths=lengths)
    # A fixed-size stop list (padded with -1) keeps one compilation for any stop set.
    stop = list(stop_tokens)
    stop = jnp.asarray(stop + [-1] * (max(8, len(stop)) - len(stop)), jnp.int32)
    out, lengths, cache = _generate_loop(
        self.graphdef, self.state, logits, cache, jax.random.PRNGKey(seed), stop,
        jnp.int32(min(max_new_tokens, room)), sampling.as_arrays(), jnp.int32(pad_id),
        jnp.asarray(np.arange(rows) < b), kv_block=self.kv_block,
        max_new=self.max_len if bucket else int(max_new_tokens))
    out = np.asarray(out)[:b, :max_new_tokens]
    if out.shape[1] < max_new_tokens:   # more asked than the cache holds: pad_id after it
      out = np.pad(out, ((0, 0), (0, max_new_tokens - out.shape[1])), constant_values=pad_id)
    if rows > b:
      cache = jax.tree.map(lambda x: x[:b], cache)
    return GenerateOutput(out, np.asarray(lengths)[:b], cache)

  def generate_stream(self, prompt, *, max_new_tokens: int,
                      sampling: SamplingConfig = SamplingConfig(),
                      stop_tokens: Sequence[int] = (), seed: int = 0) -> Iterator[int]:
    """Token streaming: yield generated ids of ONE prompt [T] (or [1, T]) as they are drawn.

    The same tokens as `generate(prompt[None], ...)` with the same seed and sampling (the
    same chunked prefill, cached decode and key chain), one host round trip per token; a
    stop token is yielded, then the stream ends. Stops after max_new_tokens or when the
    cache is full. The server's scheduler runs the same jitted step over many rows.
    """
    require_count(max_new_tokens, "max_new_tokens")
    tokens, _ = self._check_tokens(prompt, None, "prompt")
    if tokens.shape[0] != 1:
      raise ValueError(f"generate_stream takes one prompt, got a batch of {tokens.shape[0]}")
    self.check_fits(tokens.shape[1], 1, "prompt")
    room = self.max_len - tokens.shape[1]
    step = feed_and_draw_fn(self.graphdef, self.kv_block)
    row = (*row_sampling(sampling, 1), jnp.int32(sampling.vocab_limit))
    keys = np.asarray(jax.random.PRNGKey(seed))[None]
    stop, cache, tok = set(int(t) for t in stop_tokens), self.init_cache(1), None
    chunks = list(self._chunks(tokens))
    for i, (_, part, _, n_valid) in enumerate(chunks):
      draw = np.array([i == len(chunks) - 1])
      tok, _, _, keys, cache = step(self.state, part, n_valid, cache, keys, draw, *row)
    for n in range(min(int(max_new_tokens), room)):
      if n:
        tok, _, _, keys, cache = step(self.state, np.asarray(tok)[:, None],
                                      np.ones(1, np.int32), cache, keys, np.ones(1, bool), *row)
      t = int(np.asarray(tok)[0])
      yield t
      if t in stop:
        return
