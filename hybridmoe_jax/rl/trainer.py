"""The RL run: SFT warm start, then rollout -> advantages -> policy updates, with the
curriculum, evaluations, logs and exact resume (DESIGN s9). `run_train.py` calls
`train_rl(config, workdir)` when `config.rl.envs` is set.

One iteration i (1-based):
  1. the curriculum draws `groups_per_iter` (env, level) cells from
     np.random.default_rng([seed, i]); each becomes a group of `group_size` episodes of one
     new task (rl/run_state.py's seeds);
  2. the Rollout runs them, plus the episodes paused earlier, on the model's own cache with
     the current parameters; over `token_budget` an episode pauses until the next iteration;
  3. finished episodes update the curriculum and wait until their group has finished;
     finished groups get rewards (+ overlong shaping) and advantages; zero-signal groups
     are dropped (DAPO dynamic sampling);
  4. `updates_per_batch` passes over the batch in `minibatches` learner steps, with the
     reference log-probs (KL) and the rollout policy's routes (replay) computed once first;
  5. logs: a progress line, metrics.jsonl / TensorBoard, `log_trajectories` trajectories;
     every `eval_every` iterations greedy held-out success per (env, level) and
     success_by_level.png; every `save_every` a checkpoint.

Checkpoints are the pre-training ones (train/checkpoint.py); the RL host state rides in the
data record and in `rl_state/<step>.pkl` (rl/run_state.py), written before the checkpoint
of the same step. Checkpoint steps count SFT steps then iterations (sft_steps + i). Every
random draw is a function of (seed, iteration): a run killed at any point and resumed
repeats the same iterations with the same results. The reference policy (KL) is the policy
at RL start, exported once to `reference/`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from hybridmoe_jax.cli.signals import StopFlag
from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.infer.engine import Engine
from hybridmoe_jax import loading
from hybridmoe_jax.infer.sampling import SamplingConfig
from hybridmoe_jax.rl import batch as batch_lib
from hybridmoe_jax.rl import learner, run_state, sft, trajectory_log
from hybridmoe_jax.rl.chat_format import chat_ids
from hybridmoe_jax.rl.episode import Trajectory
from hybridmoe_jax.rl import progress
from hybridmoe_jax.rl.rollout import Rollout, RolloutConfig
from hybridmoe_jax.config.run import RunConfig
from hybridmoe_jax.train import checkpoint as ckpt_lib
from hybridmoe_jax.train import workdir_config
from hybridmoe_jax.train import params_export
from hybridmoe_jax.train import lifecycle
from hybridmoe_jax.train import step as step_lib
from hybridmoe_jax.train.monitor import Event
from hybridmoe_jax.train.run_inputs import run_tokenizer

def _tokenizer(config: RunConfig):
  tok = run_tokenizer(config)   # the pre-training checks (file, vocab size)
  try:
    chat_ids(tok)   # one line naming the missing roles
  except ValueError as e:
    raise ConfigError(f"config field `data.tokenizer` = {config.data.tokenizer!r}: {e}; "
                      "for bytes use 'byte_chat'") from None
  return tok


def check_rl_config(config: RunConfig) -> None:
  """Cross-section checks, before any compute."""
  rl = config.rl
  if jax.process_count() > 1:
    raise ConfigError(f"RL runs on one process (rollouts and environments live on the "
                      f"host), got {jax.process_count()} processes")
  from hybridmoe_jax.rl.envs.base import env_names, make_env  # pylint: disable=g-import-not-at-top
  for name, e in rl.envs.items():
    if name not in env_names():
      raise ConfigError(f"config field `rl.envs.{name}`: unknown environment; allowed one of "
                        f"{list(env_names())}")
    try:
      env = make_env(name, **e.kwargs)
    except (TypeError, ValueError) as err:
      raise ConfigError(f"config field `rl.envs.{name}.kwargs` = {e.kwargs}: {err}") from None
    if e.max_level > env.max_level:
      raise ConfigError(f"config field `rl.envs.{name}.max_level` = {e.max_level} is invalid: "
                        f"allowed [start_level, {env.max_level}]")
    if not run_state.eval_levels(rl, name):   # else eval_specs fails late, after the SFT
      raise ConfigError(f"config field `rl.eval_levels` = {rl.eval_levels} is invalid: allowed "
                        f"at least one level <= rl.envs.{name}.max_level = {e.max_level}")
  if rl.init_from and not os.path.isdir(rl.init_from):
    raise ConfigError(f"config field `rl.init_from` = {rl.init_from!r}: no such directory "
                      "(allowed a training workdir or a params export)")


def _check_sft_batch(rl, rt) -> None:
  if rt.mesh is None:
    return
  dp = rt.mesh.shape["data"] * rt.mesh.shape["fsdp"]
  if rl.sft_batch % dp:
    raise ConfigError(f"config field `rl.sft_batch` = {rl.sft_batch} is invalid: allowed a "
                      f"multiple of mesh.data x mesh.fsdp = {dp}")


def train_rl(config: RunConfig, workdir: str) -> dict[str, Any]:
  """Run (or resume) the RL run of `config` in `workdir`; returns a summary."""
  with open_rl_run(config, workdir) as run:
    return _train(run)


@contextlib.contextmanager
def open_rl_run(config: RunConfig, workdir: str) -> Iterator[_Run]:
  """The RL run of `config` in `workdir` inside the run lifecycle (`train/lifecycle.py`),
  restored from its newest good checkpoint or initialised (from `rl.init_from`)."""
  if not isinstance(config, RunConfig):
    raise TypeError(f"train_rl takes a RunConfig, got {type(config).__name__}: convert a "
                    "ConfigDict once with config.run.run_config_from_dict")
  if not config.rl.enabled:
    raise ConfigError("config field `rl.envs` is empty: not an RL run")
  check_rl_config(config)
  if "://" in str(workdir):   # rl_state/<step>.pkl is read before a staging dir exists
    raise ConfigError(f"--workdir={workdir}: an RL run's workdir is a local or mounted "
                      "directory; put its checkpoints in the bucket with "
                      "train.checkpoint_dir=gs://...")
  tokenizer = _tokenizer(config)
  rl, t = config.rl, config.train
  # SFT steps come first in the optimizer's count (none when starting from init_from).
  sft_steps = 0 if rl.init_from else rl.sft_steps
  hosts = {}  # a step whose rl_state/<step>.pkl is unreadable is set aside like a bad one

  def load_host(step, r):
    hosts[step] = run_state.HostState.restore(os.path.abspath(workdir), step, r.data_state)

  with lifecycle.open_run(
      config, workdir, tokenizer, schedule=learner.rl_schedule(rl, t.lr, t.warmup, sft_steps),
      batch_size=rl.group_size * rl.groups_per_iter // rl.minibatches, grad_accum=1,
      seq_len=-(-rl.max_tokens // 64) * 64, prepare=lambda rt: _check_sft_batch(rl, rt),
      check=load_host) as run:
    yield _Run(run, tokenizer, sft_steps, hosts)


def _check_init_config(src: str, model_dict) -> None:
  """ConfigError naming what differs between `rl.init_from`'s model config and this run's:
  the vocabulary first (another tokenizer), else every differing field."""
  saved = workdir_config.read_model_config(src)
  if saved is None:
    return
  if saved.get("vocab_size") != model_dict.get("vocab_size"):
    raise ConfigError(
        f"config field `rl.init_from` = {src!r}: its model has a vocabulary of "
        f"{saved.get('vocab_size')} ids, this run's model.vocab_size is "
        f"{model_dict.get('vocab_size')} (another tokenizer?); start from a run trained with this "
        "run's data.tokenizer, or set data.tokenizer and model.vocab_size to that run's")
  workdir_config.check_model_config(saved, model_dict, what=f"config field `rl.init_from` = "
                              f"{src!r} holds another model config",
                              remedy="Use the model config it was trained with.")


def _load_init(src: str, state, model_dict):
  """`state` with the params + biases of `src`: `rl.init_from` (a params export or a training
  workdir; that it is a directory is `check_rl_config`'s check) or the reference export."""
  _check_init_config(src, model_dict)
  if loading.is_export(src):
    params, biases = state.params, state.biases
    loading.load_into(src, params, biases)
  else:
    reader = ckpt_lib.Checkpointer(src, read_only=True)
    try:
      got = reader.restore_latest(lambda meta: jax.eval_shape(lambda: state), model_dict)
    finally:
      reader.close()
    if got is None:
      raise ConfigError(f"rl.init_from = {src}: no checkpoint or params export there")
    params, biases = got.state.params, got.state.biases
  return state.replace(params=params, biases=biases)


class _Run:
  """The live pieces of one RL run (built once, after restore)."""

  def __init__(self, run: lifecycle.Run, tokenizer, sft_steps: int,
               hosts: dict[int, run_state.HostState]):
    """run: the lifecycle's run (restored or initialised); hosts: the host states the
    restore read, by checkpoint step."""
    config = run.config
    self.config, self.rl, self.workdir, self.tokenizer = config, config.rl, run.workdir, tokenizer
    self.model_dict, self.sft_steps, self.schedule, self.tx = (run.model_dict, sft_steps,
                                                               run.schedule, run.tx)
    # One graph: the train steps trace it under the runtime's plan (mesh, expert-parallel
    # MoE), the rollouts (the cached forward) under the local one, over the same state.
    self.rt, self.graphdef, self.ckpt = run.rt, run.graphdef, run.ckpt
    self.state = run.state
    if run.restored is not None:
      self.host = hosts[int(run.restored.meta["step"])]
      logging.info("resumed %s at phase %s, iteration %d (checkpoint step %d)", self.workdir,
                   self.host.phase, self.host.iteration, run.restored.meta["step"])
    else:
      self.host = run_state.HostState(phase="sft" if sft_steps else "rl")
      if self.rl.init_from:
        self.state = self._placed(_load_init(self.rl.init_from, self.state, self.model_dict))
    self.curriculum = run_state.make_curriculum(self.rl, self.host.curriculum)
    self.monitor = run.begin()
    self.meta = run.meta

  # ---- checkpoints ---------------------------------------------------------------------
  def ckpt_step(self) -> int:
    return self.sft_steps * (self.host.phase == "rl") + self.host.iteration + (
        int(self.state.step) if self.host.phase == "sft" else 0)

  def save(self) -> None:
    step = self.ckpt_step()
    if step in self.ckpt.manager.all_steps():
      return
    self.host.curriculum = self.curriculum.state_dict()
    self.host.save_episodes(self.workdir, step)
    self.ckpt.save(step, self.state, self.host.record(), self.meta)
    run_state.HostState.prune(self.workdir, [*self.ckpt.manager.all_steps(), step])

  # ---- SFT -----------------------------------------------------------------------------
  def run_sft(self, stop: StopFlag) -> None:
    rl = self.rl
    demos = sft.build_demos(rl, self.tokenizer)
    batches = sft.DemoBatches(demos, rl.sft_batch, rl.seed, rl.max_tokens)
    step_fn = step_lib.make_train_step(self.graphdef, self.config.model, self.tx,
                                       grad_accum=1, schedule=self.schedule,
                                       **self.rt.step_kwargs())
    logging.info("SFT warm start: %d oracle demos, %d steps of %d x %d", len(demos),
                 rl.sft_steps, rl.sft_batch, batches.seq_len)
    t0 = time.perf_counter()
    while int(self.state.step) < self.sft_steps and stop.signum is None:
      step = int(self.state.step)
      self.state, m = step_fn(self.state, batches.batch_at(step))
      if (step + 1) % self.config.train.log_every == 0 or step + 1 == rl.sft_steps:
        loss = float(m["loss"])
        self.monitor.record(Event.SFT, step + 1, {"loss": loss, "grad_norm": m["grad_norm"],
                                              "lr": m["lr"]},
                            line=f"sft step {step + 1}/{rl.sft_steps} loss {loss:.4f} "
                                 f"({time.perf_counter() - t0:.0f}s)")
    if int(self.state.step) >= self.sft_steps:
      self.host.phase = "rl"
      self.save()

  # ---- RL ------------------------------------------------------------------------------
  def build_rollouts(self) -> None:
    rl = self.rl
    model = nnx.merge(self.graphdef, self.state.params, self.state.biases, self.state.rest)
    max_len = -(-rl.max_tokens // 64) * 64
    self.engine = Engine(model, max_len=max_len, prefill_chunk=rl.prefill_chunk)
    base = RolloutConfig(max_tokens=rl.max_tokens, max_turn_tokens=rl.max_turn_tokens,
                         token_budget=rl.token_budget,
                         sampling=SamplingConfig(temperature=rl.temperature, top_p=rl.top_p))
    self.rollout = Rollout(self.engine, self.tokenizer, base, batch=rl.rollout_batch)
    greedy = dataclasses.replace(base, token_budget=0, sampling=SamplingConfig(temperature=0.0))
    self.greedy = Rollout(self.engine, self.tokenizer, greedy, batch=rl.rollout_batch)
    # The policy trained is the one sampled (vocab limit, temperature, nucleus).
    sampling = self.rollout.config.sampling
    self.lp_fn = learner.token_logps(self.graphdef, sampling, plan=self.rt.plan)
    self.routes_fn = (learner.token_logps(self.graphdef, sampling, record_routes=True,
                                          plan=self.rt.plan)
                      if rl.routing_replay else None)
    self.rl_step = learner.make_rl_step(self.graphdef, self.config.model, self.tx, rl,
                                        self.schedule, sampling, **self.rt.step_kwargs())
    self.reference = self._reference() if rl.kl != "none" else None

  def _reference(self):
    """The frozen reference params (the policy at RL start), exported once."""
    path = os.path.join(self.workdir, run_state.REFERENCE_DIR)
    if not os.path.isdir(path):
      params_export.export_params(path, self.state.params, self.state.biases, self.model_dict)
    ref = self._placed(_load_init(path, jax.tree.map(jnp.copy, self.state), self.model_dict))
    return ref.params, ref.biases

  def _placed(self, state):
    """`state` on the run's shardings (host-loaded weights of init_from / the reference)."""
    if self.rt.mesh is None:
      return state
    return jax.device_put(state, self.rt.state_shardings)

  def _on_mesh(self):
    return (jax.set_mesh(self.rt.mesh) if self.rt.mesh is not None
            else contextlib.nullcontext())

  def _sync_engine(self) -> None:
    model = nnx.merge(self.graphdef, self.state.params, self.state.biases, self.state.rest)
    _, self.engine.state = nnx.split(model)

  def evaluate(self, i: int) -> None:
    """Greedy held-out success per (env, level) after iteration i, into the eval history
    and the metrics (logged and plotted after an RL iteration, i > 0)."""
    self._sync_engine()
    with self._on_mesh():
      res = self.greedy.run(run_state.eval_specs(self.rl))
    table = run_state.success_table(res.finished)
    self.host.eval_history.append({"iteration": i, "success": table})
    line = "eval " + " ".join(f"{c} {v:.2f}" for c, v in table.items())
    self.monitor.record(Event.EVAL, self.ckpt_step(), {"iteration": i, **{
        f"success/{c}": v for c, v in table.items()}}, line=line if i else None)
    if i:
      progress.success_figure(self.workdir, self.host.eval_history)

  def iteration(self) -> dict[str, Any]:
    rl, host = self.rl, self.host
    i = host.iteration + 1
    self._sync_engine()
    cells = self.curriculum.sample(np.random.default_rng([rl.seed, i]), rl.groups_per_iter)
    specs = run_state.iteration_specs(rl, i, host.next_group, cells)
    t0 = time.perf_counter()
    with self._on_mesh():
      res = self.rollout.run(list(host.pending) + specs)
    t_roll = time.perf_counter() - t0
    promotions = self.curriculum.update(
        [(t.env_name, t.level, float(t.reward >= 1.0)) for t in res.finished])
    by_group = collections.defaultdict(list)
    for t in list(host.waiting) + list(res.finished):
      by_group[t.group].append(t)
    ready = [t for g in sorted(by_group) if len(by_group[g]) == rl.group_size
             for t in by_group[g]]
    host.waiting = [t for g in sorted(by_group) if len(by_group[g]) < rl.group_size
                    for t in by_group[g]]
    host.pending, host.next_group = list(res.pending), host.next_group + len(cells)
    m: dict[str, Any] = {"iteration": i, "rollout_s": t_roll, "episodes": len(res.finished),
                         "paused": len(res.pending), **{
                             k: v for k, v in res.stats.items() if isinstance(v, (int, float))}}
    m.update(self._learn(ready, i))
    if res.finished:
      m["reward"] = float(np.mean([t.reward for t in res.finished]))
      m["success"] = float(np.mean([t.reward >= 1.0 for t in res.finished]))
      m["episode_tokens"] = float(np.mean([len(t.ids) for t in res.finished]))
      m["generated_tokens"] = float(np.mean([t.generated for t in res.finished]))
      for reason, n in collections.Counter(t.finish_reason for t in res.finished).items():
        m[f"finish/{reason}"] = n
      for cell, v in run_state.success_table(res.finished).items():
        m[f"success/{cell}"] = v
    for env in rl.envs:
      m[f"frontier/{env}"] = self.curriculum.frontier(env)
    m["promotions"] = len(promotions)
    for p in promotions:
      logging.info("curriculum: %s promoted to level %d (EMA %.2f over %d episodes)",
                   p["env"], p["to"], p["ema"], p["episodes"])
    host.iteration = i
    n_log = min(rl.log_trajectories, len(res.finished))
    if n_log:
      trajectory_log.write_trajectories(
          os.path.join(self.workdir, "trajectories.jsonl"),
          [dict(trajectory_log.trajectory_record(t, self.tokenizer), iteration=i)
           for t in res.finished[:n_log]])
    return m

  def _learn(self, ready: list[Trajectory], i: int) -> dict[str, Any]:
    rl = self.rl
    if not ready:
      return {"groups_trained": 0, "groups_dropped": 0}
    signals = batch_lib.episode_signals(ready, rl)
    n_groups = len({t.group for t in ready})
    kept_groups = len({t.group for t, k in zip(ready, signals["keep"]) if k})
    out = {"groups_trained": kept_groups, "groups_dropped": n_groups - kept_groups,
           "shaped_reward": float(np.mean(signals["reward"]))}
    if not kept_groups:
      return out
    rows = rl.group_size * rl.groups_per_iter
    batch = batch_lib.build_batch(ready, signals, row_multiple=rows, max_length=rl.max_tokens)
    lp_ref = routes = None
    t0 = time.perf_counter()
    with self._on_mesh():
      if self.reference is not None:
        lp_ref = self.lp_fn(*self.reference, self.state.rest, batch["tokens"],
                            batch["segment_ids"])
      if self.routes_fn is not None:
        _, routes = self.routes_fn(self.state.params, self.state.biases, self.state.rest,
                                   batch["tokens"], batch["segment_ids"])
    rng = np.random.default_rng([rl.seed, i, 3])
    logs = collections.defaultdict(list)
    n_rows = batch["tokens"].shape[0]
    for _ in range(rl.updates_per_batch):
      order = rng.permutation(n_rows)
      for part in np.array_split(order, rl.minibatches * (n_rows // rows)):
        if not batch["valid"][part].any():
          continue
        mb = {k: v[part] for k, v in batch.items()}
        ref = None if lp_ref is None else lp_ref[part]
        rts = None if routes is None else jax.tree.map(lambda x: x[part], routes)
        self.state, m = self.rl_step(self.state, mb, ref, rts)
        for k, v in m.items():
          logs[k].append(float(v))
    out.update({k: float(np.mean(v)) for k, v in logs.items()})
    out["learner_s"] = time.perf_counter() - t0
    out["updates"] = len(logs.get("loss", []))
    out["trained_tokens"] = float(np.sum(logs.get("tokens", [0.0])))
    return out


def _train(run: _Run) -> dict[str, Any]:
  """The RL run's own work: SFT steps, then iterations, until done or a signal."""
  rl = run.rl
  wall0 = time.time()
  stopped = None
  last: dict[str, Any] = {}
  with StopFlag() as stop:
    if run.host.phase == "sft":
      run.run_sft(stop)
    if run.host.phase == "rl" and stop.signum is None:
      run.build_rollouts()
      if not run.host.eval_history and rl.eval_every:
        run.evaluate(0)
      while run.host.iteration < rl.iterations and stop.signum is None:
        last = run.iteration()
        i = run.host.iteration
        line = progress.progress_line(last, rl.iterations, sft_steps=run.sft_steps)
        run.monitor.record(Event.RL, run.ckpt_step(), last, line=line)
        if (rl.eval_every and i % rl.eval_every == 0) or i == rl.iterations:
          run.evaluate(i)
        if i % rl.save_every == 0 or i == rl.iterations:
          run.save()
    stopped = signal.Signals(stop.signum).name if stop.signum else None
    if stopped:
      run.save()
  run.ckpt.wait()
  return {"phase": run.host.phase, "iteration": run.host.iteration,
          "eval_history": run.host.eval_history, "last": last, "stopped_by": stopped,
          "wall_s": time.time() - wall0, "state": run.state,
          "curriculum": run.curriculum.summary()}
