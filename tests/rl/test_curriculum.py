"""rl.curriculum: level sampling near the target, EMA arithmetic, promotion, state round trip."""

from __future__ import annotations

import collections
import json
import math
import re

import numpy as np
import pytest

from hybridmoe_jax.rl.curriculum import Curriculum, CurriculumSettings

ENVS = {"arith": (3, 5, 1.0), "code": (0, 2, 3.0)}


def _with_emas(emas: dict[int, float], settings=CurriculumSettings(min_episodes=10**6)):
  """A curriculum whose arith levels have exactly these EMAs (one update each)."""
  cur = Curriculum(ENVS, settings)
  cur.update([("arith", level, e) for level, e in emas.items()])
  return cur


def test_sampling_favours_the_level_nearest_the_target():
  cur = _with_emas({0: 0.95, 1: 0.8, 2: 0.55, 3: 0.1})
  draws = cur.sample(np.random.default_rng(0), 6000)
  counts = collections.Counter(level for env, level in draws if env == "arith")
  n = sum(counts.values())
  s = cur.settings
  w = [max(math.exp(-((e - s.target) / s.width)**2), s.floor) for e in (0.95, 0.8, 0.55, 0.1)]
  for level in range(4):
    assert counts[level] / n == pytest.approx(w[level] / sum(w), abs=0.03)
  assert max(counts, key=counts.get) == 2
  assert counts[0] > 0  # the floor: an easy level still gets sampled


def test_never_samples_locked_levels_and_respects_env_weights():
  cur = Curriculum(ENVS, CurriculumSettings())
  draws = cur.sample(np.random.default_rng(1), 4000)
  by_env = collections.defaultdict(set)
  for env, level in draws:
    by_env[env].add(level)
    assert isinstance(level, int) and isinstance(env, str)
  assert by_env == {"arith": {0, 1, 2, 3}, "code": {0}}  # frontiers 3 and 0 of max 5 and 2
  share = sum(env == "code" for env, _ in draws) / len(draws)
  assert share == pytest.approx(0.75, abs=0.03)
  assert cur.sample(np.random.default_rng(1), 0) == []


def test_ema_arithmetic_by_hand():
  cur = Curriculum(ENVS, CurriculumSettings(ema=0.7, min_episodes=100))
  assert cur.ema("code", 0) is None and cur.episodes("code", 0) == 0
  cur.update([("code", 0, 1.0), ("code", 0, 0.0), ("code", 0, 1.0), ("arith", 1, 0.25)])
  assert cur.ema("code", 0) == pytest.approx(2 / 3) and cur.episodes("code", 0) == 3
  assert cur.ema("arith", 1) == pytest.approx(0.25) and cur.ema("arith", 0) is None
  cur.update([("code", 0, 0.0), ("code", 0, 0.5)])
  assert cur.ema("code", 0) == pytest.approx(2 / 3 * 0.7 + 0.3 * 0.25)
  assert cur.episodes("code", 0) == 5
  cur.update([])
  assert cur.episodes("code", 0) == 5


def test_promotion_needs_threshold_and_min_episodes_and_stops_at_max_level():
  cur = Curriculum(ENVS, CurriculumSettings(ema=0.5, promote_at=0.7, min_episodes=4))
  assert cur.update([("code", 0, 1.0)] * 3) == []            # EMA 1.0, only 3 episodes
  assert cur.frontier("code") == 0
  events = cur.update([("code", 0, 0.375)])                  # EMA 0.6875 < 0.7, 4 episodes
  assert events == [] and cur.ema("code", 0) == pytest.approx(0.6875)
  events = cur.update([("code", 0, 0.75)])                   # EMA 0.71875
  assert events == [{"env": "code", "from": 0, "to": 1, "ema": pytest.approx(0.71875),
                     "episodes": 5}]
  assert cur.frontier("code") == 1
  # Level 2 already qualifies too, but one update promotes at most one level per env.
  assert cur.update([("code", 1, 1.0)] * 4 + [("code", 2, 1.0)] * 4) == [
      {"env": "code", "from": 1, "to": 2, "ema": 1.0, "episodes": 4}]
  assert cur.update([("code", 2, 1.0)] * 8) == []             # capped at max_level 2
  assert cur.frontier("code") == 2 and cur.frontier("arith") == 3


def test_summary_is_flat_json():
  cur = _with_emas({1: 0.5})
  summary = cur.summary()
  assert summary == {"arith/1": {"ema": 0.5, "episodes": 1}, "frontier/arith": 3,
                     "frontier/code": 0}
  json.dumps(summary)


def test_state_round_trip_through_json_gives_identical_samples():
  settings = CurriculumSettings(min_episodes=2)
  cur = Curriculum(ENVS, settings)
  rng = np.random.default_rng(3)
  for _ in range(4):
    draws = cur.sample(rng, 16)
    cur.update([(env, level, float(rng.uniform() < 0.8 / (1 + level)))
                for env, level in draws])
  state = json.loads(json.dumps(cur.state_dict()))
  back = Curriculum.from_state_dict(state, dict(reversed(ENVS.items())), settings)
  assert back.state_dict() == cur.state_dict()
  assert back.sample(np.random.default_rng(9), 200) == cur.sample(np.random.default_rng(9), 200)
  results = [("code", 0, 1.0), ("arith", 3, 0.5)] * 3
  assert back.update(results) == cur.update(results)
  assert back.state_dict() == cur.state_dict()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(ema=1.0), "`CurriculumSettings.ema` = 1.0 is invalid: allowed a number in (0, 1)"),
    (dict(ema=0.0), "`CurriculumSettings.ema` = 0.0"),
    (dict(target=1.5), "`CurriculumSettings.target` = 1.5 is invalid: allowed a number in [0, 1]"),
    (dict(width=0.0), "`CurriculumSettings.width` = 0.0 is invalid: allowed a number > 0"),
    (dict(floor=-0.1), "`CurriculumSettings.floor` = -0.1"),
    (dict(promote_at=2), "`CurriculumSettings.promote_at` = 2"),
    (dict(min_episodes=-1), "`CurriculumSettings.min_episodes` = -1 is invalid: allowed an "
                            "integer >= 0"),
    (dict(min_episodes=2.5), "`CurriculumSettings.min_episodes` = 2.5"),
])
def test_settings_errors(kwargs, fragment):
  with pytest.raises(ValueError, match=re.escape(fragment)):
    CurriculumSettings(**kwargs)


@pytest.mark.parametrize("envs, fragment", [
    ({}, "envs = {}: allowed a non-empty mapping"),
    ({"a": (3, 2, 1.0)}, "`rl.envs.a.max_level` = 2 is invalid: allowed an integer >= "
                         "start_level (3)"),
    ({"a": (-1, 2, 1.0)}, "`rl.envs.a.start_level` = -1"),
    ({"a": (0, -1, 1.0)}, "`rl.envs.a.max_level` = -1 is invalid: allowed an integer >= 0"),
    ({"a": (0, 2, 0.0)}, "`rl.envs.a.share` = 0.0 is invalid: allowed a number > 0"),
    ({"a": (0, 2)}, "envs['a'] = (0, 2): allowed (start_level, max_level, weight)"),
    ({"a/b": (0, 2, 1.0)}, "envs: name 'a/b'"),
])
def test_env_errors(envs, fragment):
  with pytest.raises(ValueError, match=re.escape(fragment)):
    Curriculum(envs, CurriculumSettings())


def test_call_errors():
  cur = Curriculum(ENVS, CurriculumSettings())
  cases = [
      (lambda: cur.sample(np.random.default_rng(0), -1), "n = -1: allowed an int >= 0"),
      (lambda: cur.sample(0, 4), "rng = 0: allowed a numpy.random.Generator"),
      (lambda: cur.update([("chess", 0, 1.0)]), "env = 'chess': allowed one of"),
      (lambda: cur.update([("code", 3, 1.0)]), "level = 3 for env 'code': allowed an int in"),
      (lambda: cur.update([("code", 0, 1.5)]), "results[0].success = 1.5: allowed a float in"),
      (lambda: cur.update([("code", 0)]), "results[0] = ('code', 0): allowed (env, level, "),
      (lambda: cur.ema("arith", 6), "level = 6 for env 'arith'"),
      (lambda: cur.frontier("x"), "env = 'x'"),
  ]
  for call, fragment in cases:
    with pytest.raises(ValueError, match=re.escape(fragment)):
      call()
  # A bad batch changes nothing, even its valid entries.
  with pytest.raises(ValueError):
    cur.update([("code", 0, 1.0), ("code", 0, -0.5)])
  assert cur.episodes("code", 0) == 0


def test_from_state_dict_rejects_other_envs_and_bad_state():
  cur = Curriculum(ENVS, CurriculumSettings())
  cur.update([("code", 0, 1.0)])
  state = json.loads(json.dumps(cur.state_dict()))
  with pytest.raises(ValueError, match=re.escape("envs: names ['arith'] differ")):
    Curriculum.from_state_dict(state, {"arith": ENVS["arith"]})
  with pytest.raises(ValueError, match=re.escape("envs['code'] = (0, 2, 2.0): differs")):
    Curriculum.from_state_dict(state, {**ENVS, "code": (0, 2, 2.0)})
  bad = json.loads(json.dumps(state))
  bad["frontier"]["arith"] = 1
  with pytest.raises(ValueError, match=re.escape("state.frontier['arith'] = 1: allowed an int "
                                                 "in [3, 5]")):
    Curriculum.from_state_dict(bad, ENVS)
  bad = json.loads(json.dumps(state))
  bad["cells"]["code"]["0"]["episodes"] = 0
  with pytest.raises(ValueError, match=re.escape("state.cells['code'][0].episodes = 0")):
    Curriculum.from_state_dict(bad, ENVS)
  with pytest.raises(ValueError, match=re.escape("state.version: allowed 1")):
    Curriculum.from_state_dict({**state, "version": 7}, ENVS)
