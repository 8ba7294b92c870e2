"""Agent evaluation: success rate per environment and level on held-out tasks.

`evaluate_agent(model, tokenizer, envs=..., levels=..., episodes=n, seed=s, policy=...)`
rolls out n tasks per (env, level) through rl.rollout.Rollout on an infer.Engine and counts
how they end. Three policies over the SAME tasks:
  model   the model, greedy by default (temperature 0), else sampled at `temperature`;
  oracle  the environment's oracle actions forced turn by turn (episode.oracle_script):
          the model still runs and its log-probs are recorded, but the actions are the
          oracle's, so every episode must score 1.0 - a check of the pipeline (chat format,
          parser, tool results, rollout bookkeeping), not of the model;
  random  a freshly initialised model of the same config (parameters from `seed`) sampling
          at temperature 1: what an untrained policy achieves (the floor).

Held-out seeds: task seeds are drawn from `seed` in [EVAL_SEED_LO, EVAL_SEED_HI) =
[2**40, 2**41); the RL trainer draws its training task seeds below 2**40, so an
evaluation task is never a training task. The seeds depend on (seed, env, level) only,
never on the policy or on the other cells.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from hybridmoe_jax.config import is_int, is_number
from hybridmoe_jax.data.retrieval import distinct
from hybridmoe_jax.infer import Engine, SamplingConfig
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.rl import chat_format, trajectory_log
from hybridmoe_jax.rl.envs.base import make_env
from hybridmoe_jax.rl.episode import EpisodeSpec, oracle_script
from hybridmoe_jax.rl.rollout import Rollout, RolloutConfig

POLICIES = ("model", "oracle", "random")
EVAL_SEED_LO = 2**40      # evaluation task seeds: [2**40, 2**41)
EVAL_SEED_HI = 2**41
_MAX_SEED = 2**63 - 1


def eval_seeds(seed: int, env: str, level: int, n: int) -> list[int]:
  """n distinct task seeds in [EVAL_SEED_LO, EVAL_SEED_HI), a function of (seed, env,
  level) only (the env name is part of the stream: two envs get different tasks)."""
  rng = np.random.default_rng([int(seed), int(level), *env.encode()])
  return distinct(lambda: int(rng.integers(EVAL_SEED_LO, EVAL_SEED_HI)), n)


def _sample_seeds(seed: int, env: str, level: int, n: int) -> list[int]:
  """Per-episode sampling seeds in [0, 2**32) (another stream than the task seeds)."""
  rng = np.random.default_rng([int(seed), int(level), 1, *env.encode()])
  return [int(x) for x in rng.integers(0, 2**32, n)]


def _hashable(v):
  """kwargs values as EpisodeSpec needs them (hashable): lists -> tuples."""
  if isinstance(v, (list, tuple)):
    return tuple(_hashable(x) for x in v)
  return v


def _check_int(name: str, v, lo: int, hi: int | None = None) -> int:
  if not is_int(v) or v < lo or (hi is not None and v > hi):
    allowed = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
    raise ValueError(f"{name} = {v!r}: allowed {allowed}")
  return int(v)


def build_specs(envs: Mapping[str, dict], levels: Mapping[str, Sequence[int]], *,
                episodes: int, seed: int, oracle: bool = False
                ) -> list[tuple[str, int, list[EpisodeSpec]]]:
  """[(env, level, specs)] per cell in the order given; every name, kwarg and level is
  checked (ValueError naming it) before anything runs; `oracle`: the oracle's actions
  forced on every turn."""
  if not isinstance(envs, Mapping) or not envs:
    raise ValueError(f"envs = {envs!r}: allowed a non-empty mapping env name -> make_env "
                     "kwargs")
  episodes = _check_int("episodes", episodes, 1)
  seed = _check_int("seed", seed, 0, _MAX_SEED)
  cells = []
  for name, kwargs in envs.items():
    if not isinstance(kwargs, Mapping):
      raise ValueError(f"envs[{name!r}] = {kwargs!r}: allowed a dict of make_env kwargs")
    try:
      env = make_env(name, **kwargs)
    except TypeError as e:
      raise ValueError(f"envs[{name!r}] kwargs {dict(kwargs)}: {e}") from None
    if name not in levels or isinstance(levels[name], (str, bytes)) or not len(levels[name]):
      raise ValueError(f"levels[{name!r}]: allowed a non-empty list of levels in [0, "
                       f"{env.max_level}] for every env, got {levels.get(name)!r}")
    env_kwargs = tuple((k, _hashable(v)) for k, v in sorted(kwargs.items()))
    for level in levels[name]:
      level = env.check_level(level)
      seeds = eval_seeds(seed, name, level, episodes)
      samples = _sample_seeds(seed, name, level, episodes)
      specs = [EpisodeSpec(name, s, level, group=i, sample_seed=ss, env_kwargs=env_kwargs)
               for i, (s, ss) in enumerate(zip(seeds, samples))]
      if oracle:
        specs = [dataclasses.replace(sp, forced=oracle_script(sp)) for sp in specs]
      cells.append((name, level, specs))
  return cells


def _fresh_like(model: HybridLM, seed: int) -> HybridLM:
  """A freshly initialised HybridLM of model's config, its arrays placed like model's
  (same devices and shardings: on a mesh it runs where the trained one runs, and the
  rollout's compiled step is reused instead of compiled again for other placements)."""
  fresh = HybridLM(model.cfg, rngs=nnx.Rngs(seed), compute=model.compute)
  placed = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                        nnx.state(fresh), nnx.state(model))
  nnx.update(fresh, placed)
  return fresh


def _pick_examples(trajs, k: int) -> list:
  """Up to k trajectories: the first success (if any) first, then the others in order."""
  win = next((t for t in trajs if t.reward == 1.0), None)
  ordered = ([win] if win is not None else []) + [t for t in trajs if t is not win]
  return ordered[:k]


def summarize(trajs, tokenizer, *, examples: int = 2) -> dict:
  """One cell's numbers from its finished Trajectories (see evaluate_agent)."""
  rewards = np.array([t.reward for t in trajs], np.float64)
  reasons = collections.Counter(t.finish_reason for t in trajs)
  return {"episodes": len(trajs), "success_rate": float(np.mean(rewards == 1.0)),
          "mean_reward": float(rewards.mean()),
          "mean_turns": float(np.mean([t.num_turns for t in trajs])),
          "mean_generated_tokens": float(np.mean([t.generated for t in trajs])),
          "mean_total_tokens": float(np.mean([len(t.ids) for t in trajs])),
          "finish_reasons": dict(sorted(reasons.items())),
          "seeds": [int(t.spec.seed) for t in trajs],
          "examples": [trajectory_log.trajectory_record(t, tokenizer)
                       for t in _pick_examples(trajs, examples)]}


def evaluate_agent(model: HybridLM, tokenizer, *, envs: Mapping[str, dict],
                   levels: Mapping[str, Sequence[int]], episodes: int, seed: int,
                   policy: str = "model", temperature: float = 0.0, max_tokens: int = 2048,
                   max_turn_tokens: int = 128, batch: int = 8, max_len: int | None = None,
                   prefill_chunk: int = 256, kv_block: int = 512, feed_width: int = 32,
                   examples: int = 2) -> dict:
  """Success per (env, level) of one policy on held-out tasks (see the module docstring).

  Args:
    model: the HybridLM to evaluate (its config also builds the "random" policy's model).
    tokenizer: with every chat role (ByteTokenizer(chat=True) or a file tokenizer).
    envs: env name -> make_env kwargs (e.g. {"arithmetic": {"brief": True}}).
    levels: env name -> the levels to evaluate it at (each in [0, env.max_level]).
    episodes: tasks per (env, level), >= 1.
    seed: draws the task seeds (see eval_seeds), the sampling seeds and the random policy's
      parameters; an int in [0, 2**63).
    policy: "model", "oracle" or "random".
    temperature: the model policy's sampling temperature (0 = greedy); the oracle is forced
      and the random policy always samples at 1.
    max_tokens: tokens per episode (prompt, turns, tool results); <= max_len.
    max_turn_tokens: tokens per assistant turn before it is cut (then malformed).
    batch: episodes in flight at once (cache rows).
    max_len: the engine's cache capacity (default max_tokens).
    prefill_chunk, kv_block: the engine's prefill chunk and MLA decode block.
    feed_width: the rollout's chunk for short tool results (0 = use prefill_chunk).
    examples: trajectories kept per cell (as trajectory_log records).

  Returns:
    {"policy", "seed", "episodes", "temperature", "envs", "cells": [per (env, level): success
    rate, mean reward / turns / tokens, finish reasons, seeds, examples], "overall", "rollout"}.

  Raises:
    ValueError (before the model runs): a bad argument (named, with its range), a tokenizer
      without chat roles, or a prompt longer than max_tokens.
  """
  if policy not in POLICIES:
    raise ValueError(f"policy = {policy!r}: allowed one of {list(POLICIES)}")
  if not is_number(temperature) or not temperature >= 0:
    raise ValueError(f"temperature = {temperature!r}: allowed a float >= 0 (0 = greedy)")
  examples = _check_int("examples", examples, 0)
  max_len = max_tokens if max_len is None else max_len
  _check_int("max_len", max_len, 2)
  cells = build_specs(envs, levels, episodes=episodes, seed=seed, oracle=policy == "oracle")
  temp = {"model": float(temperature), "oracle": 0.0, "random": 1.0}[policy]
  config = RolloutConfig(max_tokens=max_tokens, max_turn_tokens=max_turn_tokens,
                         feed_width=feed_width, sampling=SamplingConfig(temperature=temp))
  config.fits(max_len)
  chat_format.chat_ids(tokenizer)     # a tokenizer without chat roles fails here, one line
  if policy == "oracle":
    # A forced turn longer than max_turn_tokens would be cut (malformed): the oracle would
    # then fail for a reason that is not the pipeline's.
    longest = max(len(chat_format.assistant_body(tokenizer, chat_format.Message(
        "assistant", action=a))) for _, _, cell in cells for sp in cell for a in sp.forced)
    if longest > max_turn_tokens:
      raise ValueError(f"max_turn_tokens = {max_turn_tokens}: the oracle's longest turn has "
                       f"{longest} tokens; allowed >= {longest} for the oracle policy")
  if policy == "random":
    model = _fresh_like(model, int(seed) % 2**32)
  engine = Engine(model, max_len=max_len, prefill_chunk=prefill_chunk, kv_block=kv_block)
  rollout = Rollout(engine, tokenizer, config, batch=batch)
  specs = [sp for _, _, cell in cells for sp in cell]
  res = rollout.run(specs)
  out_cells, k = [], 0
  for name, level, cell in cells:
    trajs = res.finished[k:k + len(cell)]
    k += len(cell)
    out_cells.append({"env": name, "level": level,
                      **summarize(trajs, tokenizer, examples=examples)})
  rewards = np.array([t.reward for t in res.finished], np.float64)
  return {"policy": policy, "seed": int(seed), "episodes": int(episodes),
          "temperature": temp,
          "envs": {name: {k2: _plain_kw(v) for k2, v in kw.items()} for name, kw in
                   envs.items()},
          "cells": out_cells,
          "overall": {"episodes": len(rewards), "success_rate": float(np.mean(rewards == 1.0)),
                      "mean_reward": float(rewards.mean())},
          "rollout": dict(res.stats)}


def _plain_kw(v):
  return list(_plain_kw(x) for x in v) if isinstance(v, (list, tuple)) else v


def format_agent_table(results: Mapping[str, dict]) -> str:
  """policy -> evaluate_agent result as a table: one line per (env, level, policy)."""
  lines = [f"{'env':<12} {'level':>5} {'policy':<7} {'success':>8} {'reward':>7} "
           f"{'turns':>6} {'gen tok':>8}  finish reasons"]
  rows = [(c["env"], c["level"], k, policy, c) for k, (policy, r) in enumerate(results.items())
          for c in r["cells"]]
  for env, level, _, policy, c in sorted(rows, key=lambda x: x[:3]):
    reasons = ", ".join(f"{k} {v}" for k, v in c["finish_reasons"].items())
    lines.append(f"{env:<12} {level:>5} {policy:<7} {c['success_rate']:>8.2f} "
                 f"{c['mean_reward']:>7.2f} {c['mean_turns']:>6.1f} "
                 f"{c['mean_generated_tokens']:>8.1f}  {reasons}")
  return "\n".join(lines)
