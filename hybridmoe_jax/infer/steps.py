"""The jitted steps of inference over a `DecodeCache`: each is a pure function of the model
as (graphdef, state), so one compilation serves every call with the same shapes.

Shapes: B batch, P chunk, V vocab, d model width. `Engine` (infer/engine.py) chunks, checks
and calls these; the server's scheduler, the context-parallel engine, the RL rollouts and the
AOT report call them directly. `_feed_and_draw` is the one sampler of the server,
`Engine.generate_stream` and the RL rollouts. `trace_counts` says how often each traced.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.infer.sampling import draw_from, sample, sampling_logits
from hybridmoe_jax.model.cache import DecodeCache
from hybridmoe_jax.model.decoder import HybridLM

# Every jitted inference call counts its traces here by name: these steps, the server's
# batch calls (serve/batch_engine.py) and the RL rollout's row moves (rl/rollout.py).
TRACES: collections.Counter = collections.Counter()


def trace_counts() -> dict[str, int]:
  """Traces (= compilations) so far of each jitted inference call: here "prefill_chunk",
  "score_chunk", "decode_step", "generate", "embed_inputs", "feed_and_draw", "clear_row",
  "logits"; the server's "prefill", "decode", "snapshot", "restore"; the rollout's
  "put_row", "get_row" (for tests and benchmarks: none after warm-up)."""
  return dict(TRACES)


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
  TRACES["prefill_chunk"] += 1
  model = nnx.merge(graphdef, state)
  last = jnp.maximum(n_valid - 1, 0)[:, None]
  logits, cache = _forward(model, tokens, embeds, cache, n_valid, kv_block, logits_at=last)
  return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "kv_block"), donate_argnames=("cache",))
def _logits(graphdef, state, tokens, cache, n_valid, kv_block):
  """tokens [B, T], n_valid [B] real tokens per row (a prefix) -> (logits [B, T, V] fp32,
  cache): the training forward when cache is None, else the cached one over all T."""
  TRACES["logits"] += 1
  return _forward(nnx.merge(graphdef, state), tokens, None, cache, n_valid, kv_block)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed_inputs(graphdef, state, tokens, images, image_grid, image_index):
  """tokens [B, T] + image keys -> input embeddings [B, T, d] (the tower runs once)."""
  TRACES["embed_inputs"] += 1
  model = nnx.merge(graphdef, state)
  return model.embed_inputs(tokens, images, image_grid, image_index, serving=True)


@functools.partial(jax.jit, static_argnames=("graphdef", "kv_block"), donate_argnames=("cache",))
def _score_chunk(graphdef, state, tokens, targets, cache, n_valid, kv_block):
  """-> (nll [B, P] float32 of `targets`, argmax prediction [B, P] int32, cache)."""
  TRACES["score_chunk"] += 1
  model = nnx.merge(graphdef, state)
  logits, cache = _forward(model, tokens, None, cache, n_valid, kv_block)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = jax.nn.logsumexp(logits, axis=-1) - picked
  return nll, jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def _one_token(model: HybridLM, token: jax.Array, cache: DecodeCache, kv_block: int,
               n_valid: jax.Array | None = None) -> tuple[jax.Array, DecodeCache]:
  """token [B] -> (logits [B, V], cache); n_valid [B] in {0, 1} (default 1): a row with 0
  is padding (segment id 0: its cache is left as it was)."""
  n_valid = jnp.ones(token.shape, jnp.int32) if n_valid is None else n_valid
  logits, cache = _forward(model, token[:, None], None, cache, n_valid, kv_block)
  return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "kv_block"), donate_argnames=("cache",))
def _decode_step(graphdef, state, token, cache, kv_block):
  """token [B] int32 -> (logits [B, V] float32, cache)."""
  TRACES["decode_step"] += 1
  return _one_token(nnx.merge(graphdef, state), token, cache, kv_block)


@functools.partial(jax.jit, static_argnames=("graphdef", "kv_block", "max_new"),
                   donate_argnames=("cache",))
def _generate_loop(graphdef, state, logits, cache, key, stop, n_new, sampling, pad_id, live,
                   kv_block, max_new):
  """Sample up to n_new (<= max_new) tokens in one while_loop; rows stop at a stop token.

  live: bool [B], False for the rows that only pad the batch to its bucket: they start
  finished (length 0, pad_id throughout) and are fed as padding (segment id 0), so they
  change neither their cache nor any other row. The draw of row b depends only on b and
  the key (threefry bits are counted per element), so the real rows' tokens are those of an
  unpadded batch.
  """
  TRACES["generate"] += 1
  model = nnx.merge(graphdef, state)
  temperature, top_k, top_p, vocab_limit = sampling
  key, sub = jax.random.split(key)
  tok = sample(logits, sub, temperature, top_k, top_p, vocab_limit)
  tok = jnp.where(live, tok, pad_id)
  b = tok.shape[0]
  out = jnp.full((b, max_new), pad_id, jnp.int32).at[:, 0].set(tok)
  lengths = live.astype(jnp.int32)
  done = jnp.isin(tok, stop) | ~live
  n_valid = live.astype(jnp.int32)

  def cond(carry):
    i, _, _, _, done, _, _ = carry
    return (i < n_new) & ~jnp.all(done)

  def body(carry):
    i, tok, out, lengths, done, cache, key = carry
    logits, cache = _one_token(model, tok, cache, kv_block, n_valid)
    key, sub = jax.random.split(key)
    nxt = sample(logits, sub, temperature, top_k, top_p, vocab_limit)
    nxt = jnp.where(done, pad_id, nxt)
    out = jax.lax.dynamic_update_index_in_dim(out, nxt, i, axis=1)
    lengths = lengths + (~done).astype(jnp.int32)
    return i + 1, nxt, out, lengths, done | jnp.isin(nxt, stop), cache, key

  carry = (jnp.int32(1), tok, out, lengths, done, cache, key)
  _, _, out, lengths, _, cache, _ = jax.lax.while_loop(cond, body, carry)
  return out, lengths, cache


class Drawn(NamedTuple):
  """One `_feed_and_draw` step: the drawn (or forced) token per row, its log-probs and the
  advanced keys and cache."""
  token: jax.Array        # int32 [B]
  logp: jax.Array         # float32 [B] under the raw logits
  sample_logp: jax.Array  # float32 [B] under the sampling distribution (sampling_logits)
  keys: jax.Array         # uint32 [B, 2]
  cache: DecodeCache


def _feed_and_draw(graphdef, state, tokens, n_valid, cache, keys, draw, temperature, top_k,
                   top_p, vocab_limit, forced=None, *, kv_block, split_keys):
  """One cached forward over a ragged chunk, then one draw per row with the row's own key
  and sampling settings: the one sampler of the server, `Engine.generate_stream` and the RL
  rollouts (jitted per graphdef by `feed_and_draw_fn`).

  Args:
    tokens: int32 [B, W]; row b's first n_valid[b] tokens are real, the rest padding
      (segment id 0: a row with n_valid 0 leaves its cache untouched).
    n_valid: int32 [B] in [0, W].
    cache: the DecodeCache (donated).
    keys: uint32 [B, 2] per-row PRNG keys, derived by the caller; draw: bool [B], the rows
      whose key advances (split_keys only).
    temperature, top_p: float32 [B] or scalar; top_k: int32 [B] or scalar; vocab_limit:
      int32 scalar.
    forced: None, or int32 [B]: a token id to take instead of the draw, or -1 (draw).
    split_keys (static): True: key, sub = split(key), draw with sub, return the advanced key
      (a stream of one prompt then equals `generate`'s tokens with the same seed); False:
      draw with the key as given (the RL rollouts' fold_in(PRNGKey(seed), position)) and
      return the keys unchanged.

  Returns:
    Drawn: the token drawn from each row's last real token's logits (or forced), its
    log-prob under the raw logits and under the sampling distribution
    (infer.sampling.sampling_logits: the behaviour policy), keys, the new cache.
  """
  TRACES["feed_and_draw"] += 1
  model = nnx.merge(graphdef, state)
  last = jnp.maximum(n_valid - 1, 0)[:, None]
  logits, cache = _forward(model, tokens, None, cache, n_valid, kv_block, logits_at=last)
  logits = logits[:, 0].astype(jnp.float32)                                # [B, V]
  b = logits.shape[0]
  temperature, top_k, top_p = (jnp.broadcast_to(x, (b,)) for x in (temperature, top_k, top_p))

  def one(row_logits, key, t, k, p):
    nxt, sub = jax.random.split(key) if split_keys else (key, key)
    dist = sampling_logits(row_logits, t, k, p, vocab_limit)
    return draw_from(dist[None], sub, t)[0], dist, nxt

  tok, dist, advanced = jax.vmap(one)(logits, keys, temperature, top_k, top_p)
  if forced is not None:
    tok = jnp.where(forced >= 0, forced, tok)
  pick = lambda x: jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tok[:, None], -1)[:, 0]
  keys = jnp.where(draw[:, None], advanced, keys) if split_keys else keys
  return Drawn(tok, pick(logits), pick(dist), keys, cache)


@functools.lru_cache(maxsize=None)
def feed_and_draw_fn(graphdef, kv_block: int, split_keys: bool = True):
  """The jitted `_feed_and_draw` of one model graph (the graphdef is closed over: hashing
  it as a static argument on every call costs milliseconds per decoded token). Used by
  `Engine.generate_stream`, the server's continuous-batching scheduler and the RL rollouts
  (split_keys=False)."""
  return jax.jit(functools.partial(_feed_and_draw, graphdef, kv_block=kv_block,
                                   split_keys=split_keys),
                 donate_argnames=("cache",))


@functools.partial(jax.jit, donate_argnames=("cache",))
def clear_row(cache: DecodeCache, b) -> DecodeCache:
  """Row b emptied (length 0, zero KDA states / conv tails / MLA latents): a slot of a
  shared cache handed to a new sequence."""
  TRACES["clear_row"] += 1
  return jax.tree.map(lambda x: x.at[b].set(jnp.zeros_like(x[0])), cache)
