"""Environments: oracles solve every level, wrong answers score 0, horizon and size grow with
the level, episodes are deterministic, and nothing a tool or env does raises out of step."""

import subprocess
import sys

import numpy as np
import pytest

from hybridmoe_jax.rl.envs import (Answer, Environment, Malformed, Tool, ToolCall, env_names,
                                   make_env, register_env, register_tool)
from hybridmoe_jax.rl.envs.code import CodeEnv
from hybridmoe_jax.rl.envs.retrieval import RetrievalEnv
from hybridmoe_jax.rl.sandbox import SandboxLimits

CASES = [("arithmetic", lvl, seed) for lvl in (0, 1, 2, 7) for seed in (0, 1, 2)] + \
        [("retrieval", lvl, seed) for lvl in (0, 1, 3, 9) for seed in (0, 1, 2)] + \
        [("code", lvl, seed) for lvl, seed in ((0, 0), (1, 1), (2, 2))]


def _play(env, actions):
  results = [env.step(a) for a in actions]
  return results


@pytest.mark.parametrize("name, level, seed", CASES)
def test_the_oracle_solves_every_episode(name, level, seed):
  env = make_env(name)
  obs = env.reset(seed, level)
  actions = env.oracle()
  assert obs.horizon == level + 1 == sum(isinstance(a, ToolCall) for a in actions)
  assert isinstance(actions[-1], Answer) and obs.max_turns >= len(actions)
  results = _play(env, actions)
  assert all(not r.done and r.reward == 0.0 for r in results[:-1])
  assert all(not r.text.startswith("error") for r in results[:-1])
  last = results[-1]
  assert (last.done, last.reward, last.finish_reason) == (True, 1.0, "answer"), last


@pytest.mark.parametrize("name", ["arithmetic", "retrieval", "code"])
def test_wrong_answers_score_zero(name):
  env = make_env(name)
  env.reset(3, 1)
  right = env.oracle()[-1].text
  wrong = {"arithmetic": lambda: str(int(right) + 1), "retrieval": lambda: "123",
           "code": lambda: "def f0(xs):\n  return None\nf1 = f0\n"}[name]()
  r = env.step(Answer(wrong))
  assert (r.done, r.reward, r.finish_reason) == (True, 0.0, "answer")
  env.reset(3, 1)
  assert env.step(Answer("not even close")).reward == 0.0


def test_arithmetic_answer_is_exact():
  env = make_env("arithmetic")
  env.reset(5, 2)
  target = env.oracle()[-1].text
  for text, reward in [(f"  {target}\n", 1.0), (f"{target}.0", 0.0), (f"x = {target}", 0.0)]:
    env.reset(5, 2)
    assert env.step(Answer(text)).reward == reward, text


def test_horizon_and_size_grow_with_level():
  # reasoning_gym is single-turn (horizon 0 at every level): tests/rl/test_reasoning_gym_env.py
  tool_envs = [n for n in env_names() if n != "reasoning_gym"]
  assert {"arithmetic", "retrieval", "code"} <= set(tool_envs)
  for name in tool_envs:
    env = make_env(name)
    horizons = [env.horizon(level) for level in range(min(env.max_level, 6) + 1)]
    assert horizons == sorted(horizons) and horizons[1] >= 2 and horizons[-1] > horizons[0]
  env = RetrievalEnv(base_lines=8)
  lines = [env.reset(0, level).prompt.count("\n") for level in (0, 2, 5)]
  assert lines[0] < lines[1] < lines[2]
  assert [env.num_lines(level) for level in (0, 2, 5)] == [8, 24, 48]


@pytest.mark.parametrize("name", ["arithmetic", "retrieval", "code"])
def test_episodes_are_deterministic(name):
  a, b = make_env(name), make_env(name)
  assert a.reset(11, 2) == b.reset(11, 2)
  assert a.oracle() == b.oracle()
  assert a.reset(12, 2).prompt != b.reset(11, 2).prompt
  assert a.reset(11, 3).prompt != b.reset(11, 2).prompt


def test_retrieval_chain_needs_every_hop():
  env = RetrievalEnv()
  env.reset(4, 3)
  lookups = env.oracle()[:-1]
  values = [env.step(a).text for a in lookups]
  # Each value is the next key looked up; only the last one is a number.
  assert [a.argument for a in lookups[1:]] == values[:-1]
  assert values[-1].isdigit() and not any(v.isdigit() for v in values[:-1])
  assert env.step(ToolCall("lookup", "zzzzzz")).text.startswith("error: no key")


def test_code_partial_credit_and_runaway_answers():
  env = CodeEnv(limits=SandboxLimits(timeout_s=1.0, cpu_s=1))
  env.reset(0, 1)
  full = env.oracle()[-1].text
  first_only = full.split("\n\ndef f1")[0]
  r = env.step(Answer(first_only))
  assert r.reward == 0.5 and r.info["passed"] == 5 and r.info["total"] == 10
  env.reset(0, 1)
  assert env.step(Answer(f"```python\n{full}\n```")).reward == 1.0   # a fenced answer
  env.reset(0, 1)
  r = env.step(Answer("while True:\n  pass\n"))
  assert (r.reward, r.finish_reason) == (0.0, "timeout")
  env.reset(0, 1)
  r = env.step(Answer("import socket\n" + full))
  assert (r.reward, r.finish_reason, r.info["killed"]) == (0.0, "answer", "violation")
  env.reset(0, 1)
  r = env.step(ToolCall("run_tests", "import os\nos.fork()"))
  assert not r.done and "killed: violation" in r.text   # the tool reports, the episode goes on


class _Crashy(Environment):
  """A user environment whose checker crashes, with a tool that crashes."""
  name = "crashy"
  max_level = 3

  def horizon(self, level):
    return level + 1

  def _make_task(self, rng, level):
    return int(rng.integers(100))

  def _prompt(self, task):
    return f"task {task}"

  def _tools(self, task):
    return [Tool("boom", "raises", lambda arg: 1 // 0),
            Tool("number", "returns an int, not a str", lambda arg: 7),
            Tool("echo", "echoes", lambda arg: arg * 10_000)]

  def _score(self, task, answer):
    if answer == "crash":
      raise KeyError("checker bug")
    return (2.0 if answer == "too much" else 1.0), {}

  def _oracle(self, task):
    return [ToolCall("echo", "x"), Answer("ok")]


def test_crashing_tools_and_envs_are_recorded_not_raised():
  env = _Crashy()
  env.reset(0, 0)
  r = env.step(ToolCall("boom", ""))
  assert (r.done, r.reward, r.finish_reason) == (True, 0.0, "tool_error")
  assert "ZeroDivisionError" in r.info["error"]
  env.reset(0, 0)
  r = env.step(ToolCall("number", ""))
  assert r.finish_reason == "tool_error" and "returned int" in r.info["error"]
  for answer in ("crash", "too much"):
    env.reset(0, 0)
    r = env.step(Answer(answer))
    assert (r.done, r.reward, r.finish_reason) == (True, 0.0, "env_error"), r
  env.reset(0, 0)
  r = env.step(ToolCall("echo", "ab"))
  assert not r.done and len(r.text) < 4100 and "[cut: 20000 chars]" in r.text


def test_turn_limit_unknown_tools_and_malformed_turns():
  env = _Crashy(extra_turns=1)
  obs = env.reset(0, 1)
  assert obs.max_turns == 2 + 1 + 1
  r = env.step(ToolCall("nope", "1"))
  assert not r.done and r.text == "error: unknown tool 'nope'; tools: boom, number, echo"
  r = env.step(Malformed("no <end_turn>"))
  assert not r.done and r.text == "error: no <end_turn>" and r.info["malformed"]
  env.step(ToolCall("echo", ""))
  r = env.step(ToolCall("echo", ""))
  assert (r.done, r.reward, r.finish_reason) == (True, 0.0, "max_turns")
  with pytest.raises(RuntimeError, match="call reset"):
    env.step(Answer("late"))
  with pytest.raises(TypeError, match="allowed ToolCall, Answer, Malformed"):
    env.reset(0, 0) and env.step("answer")


def test_bad_levels_seeds_and_names_fail_clearly():
  env = make_env("arithmetic")
  for level in (-1, 65, 1.5, True):
    with pytest.raises(ValueError, match=r"arithmetic: level = .*: allowed an int in \[0, 64\]"):
      env.reset(0, level)
  with pytest.raises(ValueError, match=r"seed = -1: allowed an int in \[0, 2\*\*63\)"):
    env.reset(-1, 0)
  with pytest.raises(ValueError, match=r"env = 'chess': allowed one of \['arithmetic'"):
    make_env("chess")
  with pytest.raises(ValueError, match="base_lines = 0"):
    RetrievalEnv(base_lines=0)
  with pytest.raises(ValueError, match="Tool.name = 'two words'"):
    Tool("two words", "", str)


def test_users_register_environments_and_tools():
  register_env("crashy_test", _Crashy)
  shout = Tool("shout_test", "upper-cases", str.upper)
  register_tool(shout)
  with pytest.raises(ValueError, match="already registered"):
    register_tool(Tool("shout_test", "other", str.lower))
  env = make_env("crashy_test", extra_tools=("shout_test",))
  obs = env.reset(1, 0)
  assert "shout_test" in [t.name for t in obs.tools]
  assert env.step(ToolCall("shout_test", "hi")).text == "HI"
  env = make_env("arithmetic", extra_tools=(shout,))
  env.reset(0, 0)
  assert env.step(ToolCall("shout_test", "a b")).text == "A B"


def test_envs_and_sandbox_import_no_jax():
  """Environments stay numpy + stdlib: a rollout worker process need not load jax."""
  code = ("import sys; import hybridmoe_jax.rl.envs, hybridmoe_jax.rl.sandbox; "
          "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')]; "
          "print(bad)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr
  assert np.__name__ == "numpy"
