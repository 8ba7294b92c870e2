"""The RL run end to end on a tiny model: SFT warm start, iterations, logs, checkpoints,
exact resume (a run stopped after iteration 2 and resumed equals the uninterrupted one), the
same run on a data x expert mesh; config errors before compute; a SIGKILLed `run_train.py`
RL run resumes to the same losses (slow)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.rl import trainer
from hybridmoe_jax.train.state import abstract_train_state
from hybridmoe_jax.config.flags import load_config_file
from tests.conftest import ROOT

RL_TINY = ROOT / "configs" / "rl_tiny.py"
OVERRIDES = dict(iterations=3, sft_steps=2, sft_batch=4, sft_demos=8, group_size=2,
                 groups_per_iter=2, rollout_batch=4, max_tokens=128, max_turn_tokens=16,
                 minibatches=2, eval_every=2, eval_episodes=2, eval_levels=(0,),
                 save_every=1, log_trajectories=1, promote_min_episodes=2, promote_at=0.0,
                 sft_levels=(0,))


def tiny_rl_config(**rl):
  config = load_config_file(RL_TINY)
  config.model.num_layers = 2
  config.model.layer_kinds = ("kda", "mla")
  config.train.log_every = 1
  for k, v in {**OVERRIDES, **rl}.items():
    setattr(config.rl, k, v)
  config.rl.envs = {"arithmetic": {"start_level": 0, "max_level": 1, "kwargs": {"brief": True}}}
  return config


def _records(workdir, event):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r["event"] == event]


def _iteration_losses(workdir):
  return {r["iteration"]: (r.get("loss"), r.get("reward"), r.get("generated_tokens"))
          for r in _records(workdir, "rl")}


def test_rl_run_logs_checkpoints_and_resumes_exactly_and_runs_on_a_mesh(tmp_path, monkeypatch):
  ref = tmp_path / "ref"
  s = trainer.train_rl(run_config_from_dict(tiny_rl_config()), str(ref))
  assert s["phase"] == "rl" and s["iteration"] == 3 and s["stopped_by"] is None
  sft = _records(ref, "sft")
  assert [r["step"] for r in sft] == [1, 2] and all(r["loss"] > 0 for r in sft)
  rl = _records(ref, "rl")
  assert [r["iteration"] for r in rl] == [1, 2, 3]
  for r in rl:
    assert 0.0 <= r["success"] <= 1.0 and r["episodes"] == 4 and r["frontier/arithmetic"] >= 0
  evals = _records(ref, "eval")
  assert [r["iteration"] for r in evals] == [0, 2, 3]
  assert all("success/arithmetic/L0" in r for r in evals)
  assert os.path.isfile(ref / "success_by_level.png")
  with open(ref / "trajectories.jsonl") as f:
    lines = [json.loads(line) for line in f]
  assert len(lines) == 3 and all(line["env"] == "arithmetic" for line in lines)
  ckpts = sorted(int(n) for n in os.listdir(ref / "checkpoints") if n.isdigit())
  assert ckpts[-1] == 2 + 3     # sft steps + iterations
  assert os.path.isfile(ref / "rl_state" / "5.pkl")
  assert os.path.isfile(ref / "tokenizer" / "byte_chat.json")

  part = tmp_path / "part"
  s = trainer.train_rl(run_config_from_dict(tiny_rl_config(iterations=2)), str(part))
  assert s["iteration"] == 2
  s = trainer.train_rl(run_config_from_dict(tiny_rl_config()), str(part))  # resumes at iteration 2
  assert s["iteration"] == 3
  assert _iteration_losses(part) == _iteration_losses(ref)
  assert len(_records(part, "rl")) == 3 and len(_records(part, "sft")) == 2   # no redo
  assert [r["iteration"] for r in _records(part, "eval")] == [0, 2, 3]

  # data 2 x expert 2: the expert-parallel learner and SFT step (their plan), rollouts with
  # the local MoE over the same graph and sharded weights. SFT losses equal one device's; the one on-policy
  # update sees ratio 1 (the training forward recomputes the rollout's log-probs). Dynamic
  # sampling off: the update runs even when every reward is equal.
  monkeypatch.setattr("hybridmoe_jax.parallel.mesh.available_devices",
                      lambda: jax.devices()[:4])
  c = tiny_rl_config(iterations=1, minibatches=1, eval_every=0, dynamic_sampling=False)
  c.mesh.data, c.mesh.expert = 2, 2
  s = trainer.train_rl(run_config_from_dict(c), str(tmp_path / "mesh"))
  assert s["iteration"] == 1
  assert any(len(p.sharding.device_set) == 4 for p in jax.tree.leaves(s["state"].params))
  np.testing.assert_allclose([r["loss"] for r in _records(tmp_path / "mesh", "sft")],
                             [r["loss"] for r in sft], rtol=1e-5)
  (it,) = _records(tmp_path / "mesh", "rl")
  assert it["updates"] == 1 and it["groups_trained"] == 2
  assert abs(it["ratio_mean"] - 1.0) < 1e-4 and it["ratio_max"] < 1.001


def test_bad_rl_configs_fail_before_compute(tmp_path):
  with pytest.raises(ConfigError, match="rl.envs.nope"):
    c = tiny_rl_config()
    c.rl.envs = {"nope": {}}
    trainer.train_rl(run_config_from_dict(c), str(tmp_path / "a"))
  with pytest.raises(ConfigError, match="byte_chat"):
    c = tiny_rl_config()
    c.data.tokenizer = "byte"
    c.model.vocab_size = 259
    trainer.train_rl(run_config_from_dict(c), str(tmp_path / "b"))
  with pytest.raises(ConfigError, match="max_level"):
    c = tiny_rl_config()
    c.rl.envs = {"arithmetic": {"max_level": 99}}
    trainer.train_rl(run_config_from_dict(c), str(tmp_path / "c"))
  with pytest.raises(ConfigError, match="rl.minibatches"):
    trainer.train_rl(run_config_from_dict(tiny_rl_config(minibatches=3)), str(tmp_path / "d"))
  with pytest.raises(ConfigError, match=r"rl.eval_levels.*rl.envs.arithmetic.max_level = 1"):
    # no level of the held-out eval exists for this env: found before the SFT, not after
    trainer.train_rl(run_config_from_dict(tiny_rl_config(eval_levels=(2,))), str(tmp_path / "g"))
  with pytest.raises(ConfigError, match="rl.init_from"):
    trainer.train_rl(run_config_from_dict(tiny_rl_config(init_from=str(tmp_path / "missing"))),
                     str(tmp_path / "e"))
  with pytest.raises(ConfigError, match="context-parallel RL"):
    c = tiny_rl_config()
    c.mesh.context = 2
    run_config_from_dict(c)
  with pytest.raises(TypeError, match="RunConfig"):
    trainer.train_rl(tiny_rl_config(), str(tmp_path / "f"))
  assert not any((tmp_path / d).exists() for d in "abfg")


def _cli(workdir, cache, *extra):
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
  args = [sys.executable, str(ROOT / "run_train.py"), f"--config={RL_TINY}",
          f"--workdir={workdir}", "--config.rl.iterations=4", "--config.rl.sft_steps=2",
          "--config.rl.group_size=2", "--config.rl.groups_per_iter=2",
          "--config.rl.rollout_batch=4", "--config.rl.max_tokens=128",
          "--config.rl.sft_levels=(0,)", "--config.rl.envs.arithmetic.max_level=1",
          "--config.rl.eval_every=0", "--config.rl.eval_episodes=1",
          "--config.rl.eval_levels=(0,)", "--config.rl.save_every=1",
          "--config.model.num_layers=2", *extra]
  return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_sigkill_during_rl_then_resume_reproduces_the_losses(tmp_path):
  cache = tmp_path / "cache"
  ref = _cli(tmp_path / "ref", cache)
  out = ref.communicate(timeout=900)[0]
  assert ref.returncode == 0, out[-3000:]
  want = _iteration_losses(tmp_path / "ref")
  assert sorted(want) == [1, 2, 3, 4]
  run = tmp_path / "run"
  proc = _cli(run, cache)
  end = time.time() + 900
  while time.time() < end and proc.poll() is None:   # kill inside iteration 3
    if os.path.isfile(run / "metrics.jsonl") and len(_records(run, "rl")) >= 2:
      time.sleep(0.5)
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.05)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  again = _cli(run, cache)
  out = again.communicate(timeout=900)[0]
  assert again.returncode == 0, out[-3000:]
  got = _iteration_losses(run)        # the last record of an iteration wins
  assert got == want


def test_rl_mesh_errors(tmp_path, monkeypatch):
  monkeypatch.setattr("hybridmoe_jax.parallel.mesh.available_devices",
                      lambda: jax.devices()[:4])
  c = tiny_rl_config()
  c.mesh.data, c.mesh.context = 2, 2
  with pytest.raises(ConfigError, match="mesh.context"):
    trainer.train_rl(run_config_from_dict(c), str(tmp_path / "a"))
  c = tiny_rl_config(sft_batch=3)
  c.mesh.data, c.mesh.expert = 2, 2
  with pytest.raises(ConfigError, match="rl.sft_batch"):
    trainer.train_rl(run_config_from_dict(c), str(tmp_path / "b"))


def test_rollouts_and_the_expert_parallel_learner_share_one_graphdef(tmp_path, monkeypatch):
  """On a data 2 x expert 2 mesh the learner runs the expert-parallel MoE (its plan) and the
  rollouts the local one, over ONE graph: the rollout engine's graphdef is the learner's,
  which is the graphdef of the model built with no mesh at all."""
  monkeypatch.setattr("hybridmoe_jax.parallel.mesh.available_devices",
                      lambda: jax.devices()[:4])
  c = tiny_rl_config(sft_steps=0, iterations=1, minibatches=1)
  c.mesh.data, c.mesh.expert = 2, 2
  c = run_config_from_dict(c)
  with trainer.open_rl_run(c, str(tmp_path)) as run:
    assert run.rt.plan.moe_dispatch is not None
    run.build_rollouts()
    assert run.engine.graphdef == nnx.split(nnx.merge(run.graphdef, run.state.params,
                                                      run.state.biases, run.state.rest))[0]
    assert run.graphdef == abstract_train_state(c.model, c.compute, run.tx, c.train.seed)[0]
    assert not hasattr(run, "engine_graphdef")
