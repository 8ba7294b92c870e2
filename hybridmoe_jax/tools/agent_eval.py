"""`run_eval.py --task=agent`: load a run, evaluate its agent per policy, write the results.

A top-level tool (it joins the model loader and rl's evaluation): `run_agent_eval(workdir=...
or params=..., output_dir=..., options=AgentOptions())` loads the newest checkpoint (or a
params export) with `hybridmoe_jax.loading`, takes the run's own tokenizer (it must have
the chat roles: a run trained with data.tokenizer = "byte_chat" or a file tokenizer), runs
`rl.evaluate.evaluate_agent` for each policy on the same held-out tasks, prints a table
env x level x policy and writes
    <output_dir>/agent.json          {"task": "agent", "model", "options", "envs",
                                      "results": {policy: evaluate_agent's result}}
    <output_dir>/agent_success.png   success per level, one bar colour per policy.

Which environments: --agent_envs, else the envs of the run's `rl` section (read from the
checkpoint's saved run config, if it has one), else "arithmetic". Their make_env kwargs come
from that section too; --agent_brief, when given, sets `brief` in every env's kwargs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Mapping

from hybridmoe_jax import plots
from hybridmoe_jax.data.tokenizers.load import TOKENIZER_DIR, tokenizer_from_dir
from hybridmoe_jax.data.tokenizers.base import CHAT_ROLES
from hybridmoe_jax.config.flags import load_model_config
from hybridmoe_jax.loading import check_model_dir, load_model
from hybridmoe_jax.evals.runner import default_output_dir, write_result
from hybridmoe_jax.rl.envs import env_names
from hybridmoe_jax.rl.evaluate import POLICIES, evaluate_agent, format_agent_table

DEFAULT_ENV = "arithmetic"


@dataclasses.dataclass(frozen=True)
class AgentOptions:
  """The agent task's settings (run_eval.py flags).

  envs: env names; () = the run's RL envs, else DEFAULT_ENV. brief: None = each env's
  kwargs as the run saved them (False when absent); True / False overrides. feed_width:
  the rollout's chunk for short tool results (0: the prefill chunk; one compiled shape less).
  """
  envs: tuple[str, ...] = ()
  levels: tuple[int, ...] = (0, 1, 2)
  episodes: int = 16
  policies: tuple[str, ...] = POLICIES
  brief: bool | None = None
  temperature: float = 0.0
  seed: int = 0
  max_tokens: int = 2048
  max_turn_tokens: int = 128
  batch: int = 8
  prefill_chunk: int = 256
  kv_block: int = 512
  feed_width: int = 32
  examples: int = 2

  def check(self) -> None:
    """ValueError naming the flag and its allowed values (before anything loads)."""
    unknown = [e for e in self.envs if e not in env_names()]
    if unknown:
      raise ValueError(f"--agent_envs: unknown env {unknown[0]!r}; allowed "
                       f"{list(env_names())}")
    bad = [p for p in self.policies if p not in POLICIES]
    if bad or not self.policies or len(set(self.policies)) != len(self.policies):
      raise ValueError(f"--agent_policies = {','.join(self.policies)}: allowed distinct "
                       f"names from {list(POLICIES)}")
    if not self.levels or min(self.levels) < 0:
      raise ValueError(f"--agent_levels = {list(self.levels)}: allowed a non-empty list of "
                       "ints >= 0")
    for name, v in (("agent_episodes", self.episodes), ("agent_max_tokens", self.max_tokens),
                    ("agent_max_turn_tokens", self.max_turn_tokens),
                    ("agent_batch", self.batch), ("prefill_chunk", self.prefill_chunk),
                    ("kv_block", self.kv_block)):
      if v < 1:
        raise ValueError(f"--{name} = {v}: allowed an int >= 1")
    if not self.temperature >= 0:
      raise ValueError(f"--temperature = {self.temperature}: allowed >= 0 (0 = greedy)")


def options_from_flags(values: Mapping[str, Any]) -> AgentOptions:
  """AgentOptions from run_eval.py's flag values (comma lists of str, None = default)."""
  def ints(name, v):
    try:
      return tuple(int(x) for x in v)
    except ValueError:
      raise ValueError(f"--{name} = {','.join(v)}: allowed a comma list of ints") from None

  kw = {"envs": tuple(values.get("agent_envs") or ()),
        "levels": ints("agent_levels", values.get("agent_levels") or ("0", "1", "2")),
        "policies": tuple(values.get("agent_policies") or POLICIES),
        "brief": values.get("agent_brief")}
  for flag, field in (("agent_episodes", "episodes"), ("agent_max_tokens", "max_tokens"),
                      ("agent_max_turn_tokens", "max_turn_tokens"), ("agent_batch", "batch"),
                      ("temperature", "temperature"), ("seed", "seed"),
                      ("prefill_chunk", "prefill_chunk"), ("kv_block", "kv_block")):
    if values.get(flag) is not None:
      kw[field] = values[flag]
  opts = AgentOptions(**kw)
  opts.check()
  return opts


def run_rl_envs(saved_config: Mapping[str, Any] | None) -> dict[str, dict]:
  """env name -> make_env kwargs from a saved run config's `rl.envs` section (name ->
  {start_level, max_level, weight, kwargs}); {} when the run has none. Read defensively:
  a missing or odd section gives {} / empty kwargs, never an error."""
  if not isinstance(saved_config, Mapping):
    return {}
  rl = saved_config.get("rl")
  envs = rl.get("envs") if isinstance(rl, Mapping) else None
  if not isinstance(envs, Mapping):
    return {}
  out = {}
  for name, entry in envs.items():
    kwargs = entry.get("kwargs") if isinstance(entry, Mapping) else None
    out[str(name)] = dict(kwargs) if isinstance(kwargs, Mapping) else {}
  return out


def resolve_envs(opts: AgentOptions, saved_config: Mapping[str, Any] | None
                 ) -> dict[str, dict]:
  """env name -> make_env kwargs for the evaluation (see the module docstring)."""
  run_envs = run_rl_envs(saved_config)
  names = list(opts.envs) or list(run_envs) or [DEFAULT_ENV]
  out = {}
  for name in names:
    kwargs = dict(run_envs.get(name, {}))
    if opts.brief is not None:
      kwargs["brief"] = bool(opts.brief)
    out[name] = kwargs
  return out


def _chat_tokenizer(source: str, vision: bool):
  tok = tokenizer_from_dir(os.path.join(source, TOKENIZER_DIR),
                                         vision=vision)
  missing = [r for r in CHAT_ROLES if r not in tok.special_ids]
  if missing:
    raise ValueError(f"the tokenizer of {source} ({getattr(tok, 'name', 'byte')}) has no chat "
                     f"roles ({', '.join(missing)}): the agent task needs a model trained with "
                     "the chat tokenizer (--config.data.tokenizer=byte_chat "
                     "--config.model.vocab_size=266, or a tokenizer file that has the roles)")
  return tok


def run_agent_eval(*, workdir: str | None, params: str | None, output_dir: str | None,
                   options: AgentOptions = AgentOptions(), config: str | None = None,
                   echo: Callable[[str], Any] = print) -> dict[str, Any]:
  """Evaluate the agent of a run / export under every policy of `options`; write the files.

  Returns:
    {"envs": env -> kwargs, "results": policy -> evaluate_agent's result (+ "wall_s"),
     "json": path of agent.json, "figure": path of agent_success.png}.

  Raises:
    ValueError: bad options, no model, a tokenizer without chat roles (one line, before
      the model loads), a level past an env's max_level or a prompt over max_tokens.
  """
  options.check()
  if bool(workdir) == bool(params):
    raise ValueError("give exactly one of --workdir (a training run) or --params (an export)")
  source = workdir or params
  check_model_dir(source, "--workdir" if workdir else "--params")
  _chat_tokenizer(source, vision=False)             # fail before loading any weights
  expected = load_model_config(config) if config else None
  model, info = load_model(workdir=workdir, params=params, expected=expected)
  info.pop("data_config", None)
  tok = _chat_tokenizer(source, vision=model.cfg.vision.enabled)
  envs = resolve_envs(options, info.pop("run_config", None))
  levels = {name: options.levels for name in envs}
  output_dir = output_dir or default_output_dir(workdir, params)
  where = f"step {info['step']} of {workdir}" if "step" in info else params
  echo(f"model: {where}; tokenizer {getattr(tok, 'name', 'byte')} ({tok.vocab_size} ids); "
       f"envs {envs}; levels {list(options.levels)}; {options.episodes} episodes per cell")
  results = {}
  # The oracle first: it is quick, and its checks (e.g. max_turn_tokens against the oracle's
  # turns) fail before the slower policies run.
  for policy in sorted(options.policies, key=lambda p: p != "oracle"):
    t0 = time.perf_counter()
    r = evaluate_agent(model, tok, envs=envs, levels=levels, episodes=options.episodes,
                       seed=options.seed, policy=policy, temperature=options.temperature,
                       max_tokens=options.max_tokens, max_turn_tokens=options.max_turn_tokens,
                       batch=options.batch, prefill_chunk=options.prefill_chunk,
                       kv_block=options.kv_block, feed_width=options.feed_width,
                       examples=options.examples)
    r["wall_s"] = time.perf_counter() - t0
    results[policy] = r
    echo(f"policy {policy}: success {r['overall']['success_rate']:.3f} over "
         f"{r['overall']['episodes']} episodes ({r['wall_s']:.1f}s)")
  results = {p: results[p] for p in options.policies}
  echo(format_agent_table(results))
  os.makedirs(output_dir, exist_ok=True)
  json_path = os.path.join(output_dir, "agent.json")
  write_result(json_path, {"task": "agent", "model": info, "options": dataclasses.asdict(options),
                           "envs": envs, "results": results})
  fig_path = plots.save(plots.agent_eval_bars(results),
                        os.path.join(output_dir, "agent_success.png"))
  echo(f"results in {output_dir}")
  return {"envs": envs, "results": results, "json": json_path, "figure": fig_path}
