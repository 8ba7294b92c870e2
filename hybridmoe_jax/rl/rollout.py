"""Batched multi-turn rollouts on ONE DecodeCache: sample, parse, step the env, continue.

Conventions: B cache rows (slots), P the engine's prefill chunk, V vocab, n an episode's
tokens so far (see episode.py for the per-token arrays).

Each slot holds one episode. Every iteration calls the model's cached forward over chunks
[B, W]; each row feeds its own pending tokens (segment id 1; the rest of the row is padding,
segment id 0, which leaves that row's cache untouched), so rows of one call are ragged:
  - a new episode feeds its rendered prompt (system, user, <assistant> header) in chunks of P;
  - a decoding episode feeds the one token it sampled last;
  - an episode whose turn just ended feeds that turn's <end_turn>, the tool result turn and
    the next <assistant> header: O(new tokens), never a re-prefill of the history;
  - finished and paused slots feed nothing until a queued episode takes them.
Rows are grouped by the width their pending tokens need (1; feed_width for a short tool
result; else P), one call per group (three compiled shapes in all), so a row's arithmetic
never depends on its neighbours. In the same jitted call (infer.steps.feed_and_draw_fn, the
server's sampler too) every row whose pending tokens are all cached draws its next token
from its last real token's logits with the key fold_in(PRNGKey(sample_seed), position): an
episode's tokens and log-probs do not depend on its batch neighbours, its slot, or on being
paused and resumed (bit for bit). A forced turn (teacher forcing, e.g. the oracle's
actions) replaces the drawn token by the script's in the same call; its log-probs are
recorded all the same.

A turn ends at <end_turn> (or is cut at `max_turn_tokens`: the chat parser reports it as
Malformed). The sampled ids are parsed as they are (chat_format.parse_message: token-in /
token-out), the environment steps, and the episode finishes (reward, finish reason) or
queues the tool result. Episodes stop at `max_tokens` tokens (finish reason max_tokens).
With `token_budget`, an episode that has generated that many tokens in this `run` pauses:
it leaves as a PendingEpisode holding its cache row, to be passed to a later `run`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybridmoe_jax.config import Checked, ranged, require
from hybridmoe_jax.infer.engine import Engine
from hybridmoe_jax.infer.steps import TRACES, clear_row, feed_and_draw_fn
from hybridmoe_jax.infer.sampling import SamplingConfig
from hybridmoe_jax.model.cache import DecodeCache
from hybridmoe_jax.rl import chat_format
from hybridmoe_jax.rl.chat_format import Message
from hybridmoe_jax.rl.episode import (TOKEN_FIELDS, EpisodeSpec, PendingEpisode, Trajectory)

# ---- the jitted pieces -------------------------------------------------------------------

@jax.jit
def _row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
  """uint32 [B, 2]: row b draws with fold_in(PRNGKey(seeds[b]), positions[b])."""
  return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seeds, positions)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _put_row(cache: DecodeCache, row: DecodeCache, b) -> DecodeCache:
  """Row b := the batch-1 cache `row` (a resumed episode)."""
  TRACES["put_row"] += 1
  return jax.tree.map(lambda x, r: x.at[b].set(r[0]), cache, row)


@jax.jit
def _get_row(cache: DecodeCache, b) -> DecodeCache:
  """The batch-1 cache of row b (a pausing episode)."""
  TRACES["get_row"] += 1
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, b, keepdims=True), cache)


# ---- configuration and results ----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RolloutConfig(Checked):
  """Checked when built (ConfigError naming `rollout.<field>`); `fits` checks max_tokens
  against the engine.

  Attributes:
    max_tokens: per episode, all tokens (prompt, turns, tool results); <= the engine's
      max_len.
    max_turn_tokens: tokens per assistant turn (then the turn is cut).
    max_turns: assistant turns per episode, 0 = the environment's own limit only.
    token_budget: tokens an episode may generate per `run` call before it pauses; 0 = none.
    feed_width: the chunk width of short multi-token feeds (a tool result and the next
      header): a third compiled shape between 1 and the engine's prefill chunk P, so a short
      tool result does not pay for a [B, P] chunk; 0 (or >= P) = off.
    sampling: temperature / top_k / top_p / vocab_limit (vocab_limit 0 becomes the
      tokenizer's vocabulary size: ids past it are never drawn).
  """
  PATH = "rollout"
  max_tokens: int = ranged(2048, ">= 2")
  max_turn_tokens: int = ranged(256, ">= 1")
  max_turns: int = ranged(0, ">= 0")
  token_budget: int = ranged(0, ">= 0")
  feed_width: int = ranged(32, ">= 0")
  sampling: SamplingConfig = SamplingConfig(temperature=1.0)

  def check(self, p: str) -> None:
    require(isinstance(self.sampling, SamplingConfig), f"{p}.sampling", self.sampling,
            "a SamplingConfig")

  def fits(self, max_len: int) -> None:
    """ConfigError unless max_tokens <= the engine's max_len (the cache capacity)."""
    require(self.max_tokens <= max_len, "rollout.max_tokens", self.max_tokens,
            f"an integer in [2, {max_len}] (the engine's max_len, the cache capacity)")


@dataclasses.dataclass
class RolloutResult:
  """finished / pending: in the order the episodes were given; stats: throughput and counts
  (generated_tokens: sampled or forced assistant tokens; total_tokens: every token fed
  to the cache, prompts and tool results included; *_per_s over the wall time)."""
  finished: list
  pending: list
  stats: dict


@dataclasses.dataclass
class _Row:
  """The live state of one slot's episode (host side)."""
  index: int
  spec: EpisodeSpec
  env: object
  tokens: dict                 # field -> python list
  to_feed: list                # ids not yet in the cache (a suffix of ids)
  messages: list
  actions: list
  turn_tokens: int
  num_turns: int
  prompt_len: int
  generated_here: int = 0      # tokens generated in this run (the budget)
  max_turns: int = 0
  last_info: dict = dataclasses.field(default_factory=dict)

  def append(self, tok, mask=0, forced=0, logp=0.0, sample_logp=0.0, turn=0):
    for k, v in zip(TOKEN_FIELDS, (tok, mask, forced, logp, sample_logp, turn)):
      self.tokens[k].append(v)

  def extend(self, ids, turns):
    for i, t in zip(ids, turns):
      self.append(int(i), turn=int(t))

  @property
  def n(self) -> int:
    return len(self.tokens["ids"])

  def arrays(self) -> dict:
    return {k: np.asarray(v, np.float32 if "logp" in k else np.int32)
            for k, v in self.tokens.items()}


class Rollout:
  """Rolls out episodes B at a time on one cache of the engine's model.

  Args:
    engine: an infer.Engine (its model, max_len = cache capacity, prefill_chunk P, kv_block).
    tokenizer: with every chat role (e.g. ByteTokenizer(chat=True)); its vocabulary must
      fit the model's.
    config: a RolloutConfig.
    batch: B, cache rows (episodes in flight at once).
  """

  def __init__(self, engine: Engine, tokenizer, config: RolloutConfig = RolloutConfig(), *,
               batch: int = 8):
    if not (isinstance(batch, (int, np.integer)) and batch >= 1):
      raise ValueError(f"rollout batch = {batch!r}: allowed an int >= 1")
    config.fits(engine.max_len)
    self.roles = chat_format.chat_ids(tokenizer)
    if tokenizer.vocab_size > engine.cfg.vocab_size:
      raise ValueError(f"tokenizer vocab_size {tokenizer.vocab_size} > model vocab_size "
                       f"{engine.cfg.vocab_size}: set model.vocab_size >= "
                       f"{tokenizer.vocab_size}")
    sampling = config.sampling
    if sampling.vocab_limit == 0 or sampling.vocab_limit > tokenizer.vocab_size:
      sampling = dataclasses.replace(sampling, vocab_limit=int(tokenizer.vocab_size))
    self.engine, self.tokenizer, self.batch = engine, tokenizer, int(batch)
    self.config = dataclasses.replace(config, sampling=sampling)
    self._sampling = sampling.as_arrays()
    self._step = feed_and_draw_fn(engine.graphdef, engine.kv_block, split_keys=False)

  # ---- episode start / resume ------------------------------------------------------------

  def _start(self, index: int, spec: EpisodeSpec) -> _Row:
    env = spec.make_env()
    obs = env.reset(spec.seed, spec.level)
    messages = chat_format.initial_messages(obs)
    r = chat_format.render(self.tokenizer, messages, add_generation_prompt=True)
    if len(r.ids) + 1 > self.config.max_tokens:
      raise ValueError(f"episode {index} ({spec.env} seed {spec.seed} level {spec.level}): "
                       f"its prompt has {len(r.ids)} tokens, rollout.max_tokens = "
                       f"{self.config.max_tokens} leaves no room to generate (raise it)")
    row = _Row(index, spec, env, {k: [] for k in TOKEN_FIELDS}, [int(i) for i in r.ids],
               messages, [], 0, 0, len(r.ids))
    row.extend(r.ids, r.turn_index)
    row.max_turns = self._max_turns(obs.max_turns)
    return row

  def _max_turns(self, env_turns: int) -> int:
    return min(env_turns, self.config.max_turns) if self.config.max_turns else env_turns

  def _resume(self, index: int, p: PendingEpisode) -> _Row:
    env = p.env if p.env is not None else _replay(p)
    n = len(p.tokens["ids"])
    if not 0 < p.n_cached <= n or p.cache.batch != 1 or \
        int(np.asarray(p.cache.length)[0]) != p.n_cached:
      raise ValueError(f"pending episode {index}: n_cached = {p.n_cached} must be in [1, {n}] "
                       "and equal its batch-1 cache row's length")
    if p.cache.max_len != self.engine.max_len:
      raise ValueError(f"pending episode {index}: its cache row holds {p.cache.max_len} "
                       f"positions, the engine's max_len is {self.engine.max_len}")
    tokens = {k: [v.item() for v in np.asarray(p.tokens[k])] for k in TOKEN_FIELDS}
    row = _Row(index, p.spec, env, tokens, tokens["ids"][p.n_cached:], list(p.messages),
               list(p.actions), p.turn_tokens, p.num_turns, p.prompt_len)
    row.max_turns = self._max_turns(env.observation.max_turns)
    return row

  def _width(self, pending: int) -> int:
    """The chunk width a row feeding `pending` tokens uses: 1, feed_width or P, the smallest
    that holds them (P for longer feeds, in several calls). It depends on the row alone, so
    a row's arithmetic never depends on its neighbours (paused == uninterrupted, exactly)."""
    p, f = self.engine.prefill_chunk, self.config.feed_width
    if pending <= 1:
      return 1
    return f if 1 < f < p and pending <= f else p

  # ---- per-token bookkeeping ---------------------------------------------------------------

  def _forced_token(self, row: _Row) -> int:
    """The script's token for row's next position, or -1 to sample."""
    forced = row.spec.forced
    if row.num_turns >= len(forced) or forced[row.num_turns] is None:
      return -1
    f = forced[row.num_turns]
    body = f if isinstance(f, tuple) else tuple(chat_format.assistant_body(
        self.tokenizer, Message("assistant", action=f)).tolist())
    return int(body[row.turn_tokens]) if row.turn_tokens < len(body) else -1

  def _take_token(self, row: _Row, tok: int, logp: float, sample_logp: float, forced: bool
                  ) -> tuple | None:
    """Record one generated token; -> None (continue) or (reward, reason) when finished."""
    cfg = self.config
    row.append(tok, 1, int(forced), logp, sample_logp, len(row.messages))
    row.turn_tokens += 1
    row.generated_here += 1
    row.to_feed = [tok]
    turn_over = tok == self.roles["end_turn"] or row.turn_tokens >= cfg.max_turn_tokens
    if not turn_over:
      if row.n >= cfg.max_tokens:
        self._close_turn(row)           # the cut turn stays on the trajectory as a message
        return 0.0, "max_tokens"
      return None
    action = self._close_turn(row)
    result = row.env.step(action)
    row.num_turns += 1
    row.actions.append(action)
    row.last_info = dict(result.info)
    if result.done:
      return float(result.reward), result.finish_reason
    if row.num_turns >= row.max_turns:
      return 0.0, "max_turns"
    message = Message("tool_result", result.text)
    ids, _ = chat_format.render_message(self.tokenizer, message)
    header = chat_format.generation_prompt(self.tokenizer)
    if row.n + len(ids) + len(header) + 1 > cfg.max_tokens:
      return 0.0, "max_tokens"
    turn = len(row.messages)
    row.messages.append(message)
    row.extend(ids, [turn] * len(ids))
    row.extend(header, [turn + 1])
    row.to_feed = [tok] + [int(i) for i in ids] + [int(i) for i in header]
    return None

  def _close_turn(self, row: _Row):
    """Parse the current turn's sampled ids into an assistant Message; -> its action."""
    body = row.tokens["ids"][row.n - row.turn_tokens:]
    message = chat_format.parse_message(self.tokenizer, body)
    row.messages.append(message)
    row.turn_tokens = 0
    return message.action

  def _finish(self, row: _Row, reward: float, reason: str) -> Trajectory:
    a = row.arrays()
    return Trajectory(row.spec, a["ids"], a["loss_mask"], a["forced"], a["logp"],
                      a["sample_logp"], a["turn_index"], tuple(row.messages), float(reward),
                      str(reason), sum(m.role == "assistant" for m in row.messages),
                      row.prompt_len, row.last_info)

  def _pause(self, row: _Row, cache: DecodeCache, slot: int) -> PendingEpisode:
    return PendingEpisode(row.spec, row.arrays(), row.n - len(row.to_feed),
                          _get_row(cache, jnp.int32(slot)), tuple(row.actions),
                          tuple(row.messages), row.turn_tokens, row.num_turns, row.prompt_len,
                          env=row.env)

  def _call(self, slots, members, width: int, cache: DecodeCache):
    """One feed_and_draw call feeding up to `width` pending tokens of each member slot
    (the other rows idle) -> (cache, {slot: (token or None if the row still has tokens to
    feed, logp, sample_logp, forced?, tokens fed)})."""
    b = self.batch
    tokens = np.zeros((b, width), np.int32)
    n_valid = np.zeros(b, np.int32)
    seeds = np.zeros(b, np.uint32)
    positions = np.zeros(b, np.int32)
    forced = np.full(b, -1, np.int32)
    for s in members:
      row = slots[s]
      part, row.to_feed = row.to_feed[:width], row.to_feed[width:]
      tokens[s, :len(part)] = part
      n_valid[s] = len(part)
      seeds[s], positions[s] = row.spec.sample_seed, row.n
      if not row.to_feed:
        forced[s] = self._forced_token(row)
    tok, logp, slp, _, cache = self._step(
        self.engine.state, tokens, n_valid, cache, _row_keys(seeds, positions),
        np.zeros(b, bool), *self._sampling, forced)
    tok, logp, slp = np.asarray(tok), np.asarray(logp), np.asarray(slp)
    out = {}
    for s in members:
      drew = not slots[s].to_feed
      out[s] = (int(tok[s]) if drew else None, float(logp[s]), float(slp[s]),
                bool(forced[s] >= 0), int(n_valid[s]))
    return cache, out

  # ---- the loop --------------------------------------------------------------------------

  def run(self, episodes: Sequence[EpisodeSpec | PendingEpisode]) -> RolloutResult:
    """Rolls out `episodes` (new specs and / or paused ones) B at a time.

    Returns a RolloutResult: finished Trajectories and (with a token budget) the
    PendingEpisodes to pass to a later run.

    Raises:
      ValueError: a bad spec or pending episode, or a prompt longer than max_tokens (all
        checked before the model runs).
    """
    items = list(episodes)
    if not items:
      raise ValueError("rollout.run: no episodes given")
    for i, e in enumerate(items):
      spec = e.spec if isinstance(e, PendingEpisode) else e
      if not isinstance(spec, EpisodeSpec):
        raise ValueError(f"episodes[{i}]: allowed an EpisodeSpec or a PendingEpisode, got "
                         f"{type(e).__name__}")
      spec.check(f"episodes[{i}]")
      for j, f in enumerate(spec.forced):
        if isinstance(f, tuple) and not all(0 <= t < self.tokenizer.vocab_size for t in f):
          raise ValueError(f"episodes[{i}].forced[{j}]: token ids must lie in [0, "
                           f"{self.tokenizer.vocab_size}) (the tokenizer's vocabulary)")
    t0 = time.perf_counter()
    # Environments are built and prompts rendered up front: bad input fails before compute.
    queue = collections.deque(
        self._resume(i, e) if isinstance(e, PendingEpisode) else self._start(i, e)
        for i, e in enumerate(items))
    pending_rows = {i: e for i, e in enumerate(items) if isinstance(e, PendingEpisode)}
    b = self.batch
    cache = self.engine.init_cache(b)
    slots: list[_Row | None] = [None] * b
    finished, paused = {}, {}
    stats = collections.Counter()
    env_seconds = 0.0

    while queue or any(slots):
      for s in range(b):
        if slots[s] is None and queue:
          row = queue.popleft()
          slots[s] = row
          if row.index in pending_rows:
            cache = _put_row(cache, pending_rows[row.index].cache, jnp.int32(s))
          else:
            cache = clear_row(cache, jnp.int32(s))
      # Rows are grouped by their own feed width, one call per width (see _width).
      widths = [self._width(len(r.to_feed)) if r is not None else 0 for r in slots]
      draws = {}
      for width in sorted(set(widths) - {0}, reverse=True):
        members = [s for s, w in enumerate(widths) if w == width]
        cache, got = self._call(slots, members, width, cache)
        draws.update(got)
        stats["model_calls"] += 1
        stats["chunk_calls" if width > 1 else "decode_calls"] += 1
        stats["total_tokens"] += sum(n for *_, n in got.values())
      for s, (tok, logp, slp, forced, _) in sorted(draws.items()):
        if tok is None:
          continue                      # fed part of a longer prompt / tool result
        row = slots[s]
        te = time.perf_counter()
        done = self._take_token(row, tok, logp, slp, forced)
        env_seconds += time.perf_counter() - te
        stats["generated_tokens"] += 1
        if done is not None:
          finished[row.index] = self._finish(row, *done)
          slots[s] = None
        elif self.config.token_budget and row.generated_here >= self.config.token_budget:
          paused[row.index] = self._pause(row, cache, s)
          slots[s] = None

    wall = time.perf_counter() - t0
    out = dict(stats, episodes=len(items), finished=len(finished), paused=len(paused),
               wall_s=wall, env_s=env_seconds)
    out["generated_tokens_per_s"] = out.get("generated_tokens", 0) / wall
    out["total_tokens_per_s"] = out.get("total_tokens", 0) / wall
    return RolloutResult([finished[i] for i in sorted(finished)],
                         [paused[i] for i in sorted(paused)], out)


def _replay(p: PendingEpisode):
  """A fresh environment brought to p's state by reset + its recorded actions; checks that
  each tool result matches the recorded conversation (environments are deterministic)."""
  env = p.spec.make_env()
  env.reset(p.spec.seed, p.spec.level)
  results = [m.text for m in p.messages if m.role == "tool_result"]
  for i, action in enumerate(p.actions):
    result = env.step(action)
    if result.done or i >= len(results) or result.text != results[i]:
      raise RuntimeError(f"pending episode ({p.spec.env} seed {p.spec.seed}): replaying "
                         f"action {i} gave a different result; the environment is not "
                         "deterministic, so the episode cannot be resumed without its live env")
  return env
