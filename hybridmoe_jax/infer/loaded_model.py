"""`LoadedModel` (what `hybridmoe_jax.api.load` returns): text in / text out over
`infer.Engine`: generate, generate_stream, score, forward, cache sizes.

B texts / prompts, T tokens, V vocabulary, N = max_len (the cache capacity, fixed per
LoadedModel). What compiles: `generate` once per batch bucket (B rounded up to a power of
two), never per max_new_tokens, prompt length, sampling setting or seed
(`Engine.generate`); `generate_stream` once; `score` and `forward` per (B, padded T). Text is encoded with BOS first;
generation stops at EOS by default. Ragged rows are right-padded to one width and go to the
engine in one call with their lengths (the padding is marked as such: no row changes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.infer.engine import Engine, require_count
from hybridmoe_jax.infer.sampling import SamplingConfig
from hybridmoe_jax.infer.streaming import TextStream, stream_text
from hybridmoe_jax.model.cache import cache_bytes, init_cache, mla_bytes_per_token
from hybridmoe_jax.model.decoder import HybridLM


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

  def pad_rows(self, rows: Sequence[np.ndarray], extra: int = 0, what: str = ""
               ) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows -> (tokens int32 [B, T] right-padded with the pad id, lengths int32 [B]);
    with `what`, the longest row + `extra` new tokens must fit the cache."""
    lengths = np.asarray([len(r) for r in rows], np.int32)
    if what:
      self.engine.check_fits(int(lengths.max()), extra, what)
    tokens = np.full((len(rows), int(lengths.max())), self.tokenizer.pad_id, np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(r)] = r
    return tokens, lengths

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
      seed: the sampling key (the prompts share one engine call and key).
      stop: strings that end a continuation: the text is cut before the first one.
      stop_tokens: ids that end a row's generation (default: the tokenizer's EOS); the stop
        token itself is not decoded.

    Returns:
      The continuation (new text only): a str for one prompt, else a list in prompt order.

    Compiles on the first call of each batch bucket (1, 2, 4, 8, ... prompts) only.
    """
    max_new_tokens, sampling, stop, stop_set = self._generation_args(
        max_new_tokens, temperature, top_k, top_p, stop, stop_tokens)
    rows, single, _ = self._as_rows(prompts, "prompt", bos=True)
    tokens, lengths = self.pad_rows(rows, max_new_tokens, "prompt")
    out = self.engine.generate(tokens, max_new_tokens=max_new_tokens, sampling=sampling,
                               stop_tokens=tuple(stop_set), seed=seed,
                               pad_id=self.tokenizer.pad_id, prompt_lengths=lengths)
    texts: list[str] = []
    for i in range(len(rows)):
      ids = out.tokens[i, :out.lengths[i]]
      if len(ids) and int(ids[-1]) in stop_set:
        ids = ids[:-1]
      texts.append(stream_text(self.tokenizer, ids, stop))
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
    max_new_tokens, sampling, stop, stop_set = self._generation_args(
        max_new_tokens, temperature, top_k, top_p, stop, stop_tokens)
    rows, single, _ = self._as_rows(prompt, "prompt", bos=bos)
    if not single:
      raise ValueError(f"generate_stream takes one prompt (a str or token ids [T]), got "
                       f"{len(rows)}; use generate for a batch")
    self.engine.check_fits(len(rows[0]), max_new_tokens, "prompt")
    text = TextStream(self.tokenizer, stop)
    for tok in self.engine.generate_stream(rows[0], max_new_tokens=max_new_tokens,
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
                       ) -> tuple[int, SamplingConfig, tuple[str, ...], set[int]]:
    """Checked generation arguments -> (max_new_tokens, SamplingConfig, stop strings, stop
    ids)."""
    max_new_tokens = require_count(max_new_tokens, "max_new_tokens")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p,
                              vocab_limit=self.tokenizer.vocab_size)
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if stop_tokens is None:
      stop_tokens = (self.tokenizer.eos_id,)
    return max_new_tokens, sampling, stop, set(int(s) for s in stop_tokens)

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
    tokens, lengths = self.pad_rows(rows, 0, "text")
    nll, _ = self.engine.score(tokens, lengths)
    out: list[TextScore] = []
    for i, item in enumerate(items):
      row_nll = nll[i, :lengths[i] - 1].astype(np.float32)
      total = float(row_nll.astype(np.float64).sum())
      num_bytes = (len(item.encode("utf-8")) if isinstance(item, str)
                   else self._num_bytes(rows[i][1:]))
      out.append(TextScore(tokens=rows[i], logprobs=-row_nll, nll=total,
                           perplexity=math.exp(total / len(row_nll)), num_bytes=num_bytes,
                           bits_per_byte=total / math.log(2) / max(num_bytes, 1)))
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
    tokens, lengths = self.pad_rows(rows, 0, "inputs" if return_cache else "")
    return self.engine.forward(tokens, lengths, return_cache=return_cache)

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
  max_len, batch = (require_count(v, name, "cache_sizes: ")
                    for name, v in (("max_len", max_len), ("batch", batch)))
  shapes = jax.eval_shape(lambda: init_cache(config, batch, max_len, dtype=dtype))
  out = cache_bytes(shapes)   # ShapeDtypeStructs carry the size and dtype it reads
  out["mla_per_token"] = mla_bytes_per_token(config, dtype=dtype)
  return out
