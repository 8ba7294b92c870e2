"""The one config tree: every field with a declared range (config.ranged) is rejected by
run_config_from_dict, naming its dotted field, when set just outside that range in any
preset of configs/; the RL curriculum's ranges and defaults are the `rl` section's."""

import dataclasses
import re
import types
import typing

import pytest

from hybridmoe_jax.config import Allowed, Checked, ConfigError
from hybridmoe_jax.rl.curriculum import Curriculum
from hybridmoe_jax.config.rl import RL_CURRICULUM_FIELDS, CurriculumSettings, RLConfig
from hybridmoe_jax.config.run import RunConfig, run_config_from_dict
from tests.conftest import ROOT, load_config

PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.py"))
# Values tried against an `Allowed` test: the first it rejects is the bad value.
CANDIDATES = {int: [0, -2, 24], str: ["", " x", "3-4", "v9-3"], float: [-1.0],
              tuple: [(), ("",), (12, 8)], dict: [{"count": 0.0}], bool: [1, "yes"]}


def _base(tp):
  """The annotation without Optional; (origin or type, element type)."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  return (origin or tp), (args[-1] if args else tp)


def _outside(spec: str, integer: bool) -> list:
  """Values just outside an interval spec ('>= 1', '(0, 10]', ...): both ends, each open
  end exactly at its bound."""
  m = re.fullmatch(r"(>=?) (\S+)|([\[(])(\S+), (\S+)([\])])", spec)
  step = 1 if integer else 0.5
  cast = int if integer else float
  if m[1]:
    lo = cast(float(m[2]))
    return [lo if m[1] == ">" else lo - step]
  lo, hi = cast(float(m[4])), cast(float(m[5]))
  return [lo if m[3] == "(" else lo - step, hi if m[6] == ")" else hi + step]


def _bad_values(tp, meta) -> list[tuple[object, str]]:
  """(bad value, the suffix of the field the error must name) for a field typed `tp`."""
  spec, (origin, elem) = meta["allowed"], _base(tp)
  if isinstance(spec, Allowed):
    bad = [v for v in CANDIDATES[origin] if not spec.ok(v)]
    assert bad, f"no candidate value outside {spec.text}"
    return [(bad[0], "")]
  if isinstance(spec, tuple):
    one = ["__bogus__"] if isinstance(spec[0], str) else [max(spec) + 1]
  else:
    one = _outside(spec, elem is int)
  if origin is tuple:
    return [((v,), "[0]") for v in one] + ([((), "")] if meta["nonempty"] else [])
  if origin is dict:
    return [({"web": v}, ".web") for v in one]
  return [(v, "") for v in one]


def _walk(obj, path: str):
  """(dotted path, class, field, value) of every field of the tree under `obj`."""
  hints = typing.get_type_hints(type(obj))
  for f in dataclasses.fields(obj):
    value, name = getattr(obj, f.name), f"{path}.{f.name}".lstrip(".")
    yield name, hints[f.name], f, value
    items = (value.items() if isinstance(value, dict) else enumerate(value)
             if isinstance(value, tuple) else [(None, value)])
    for k, sub in items:
      if isinstance(sub, Checked):
        yield from _walk(sub, name if k is None else f"{name}[{k}]" if isinstance(value, tuple)
                         else f"{name}.{k}")


def _set(root: dict, path: str, value) -> None:
  keys = [int(k) if k.isdigit() else k for k in re.split(r"\.|\[|\]\.?", path) if k]
  node = root
  for k in keys[:-1]:
    node = node[k]
  node[keys[-1]] = value


def _plain(config) -> dict:
  """The ConfigDict as nested dicts and lists (stages: a list of dicts), to edit."""
  d = config.to_dict()
  d["curriculum"]["stages"] = [dict(s) for s in d["curriculum"].get("stages", ())]
  return d


@pytest.mark.parametrize("preset", PRESETS)
def test_every_ranged_field_rejects_a_value_outside_its_range(preset):
  config = load_config(preset)
  tree = run_config_from_dict(config)
  checked = 0
  for path, tp, f, _ in _walk(tree, ""):
    origin, elem = _base(tp)
    if "allowed" not in f.metadata:
      # Every number of the tree has a declared range.
      assert elem not in (int, float), f"{path}: a number field without a range"
      continue
    for bad, suffix in _bad_values(tp, f.metadata):
      d = _plain(config)
      _set(d, path, bad)
      with pytest.raises(ConfigError) as e:
        run_config_from_dict(d)
      msg = str(e.value)
      assert f"config field `{path}{suffix}` = " in msg and "is invalid: allowed" in msg, (
          path, bad, msg)
      assert "\n" not in msg
      checked += 1
  assert checked > 150


def test_rl_curriculum_fields_are_the_curriculum_settings():
  """rl.curriculum_* / rl.promote_* and rl/curriculum.py's settings: one definition."""
  rl_fields = {f.name: f for f in dataclasses.fields(RLConfig)}
  for rl_name, name in RL_CURRICULUM_FIELDS.items():
    ours = CurriculumSettings.__dataclass_fields__[name]
    assert rl_fields[rl_name].default == ours.default, rl_name
    assert rl_fields[rl_name].metadata == ours.metadata, rl_name
  assert sorted(RL_CURRICULUM_FIELDS.values()) == sorted(
      f.name for f in dataclasses.fields(CurriculumSettings))
  assert RLConfig().curriculum == CurriculumSettings()
  # The same values pass or fail both ways (the old ranges differed on these).
  for rl_name, name, value, ok in (("curriculum_width", "width", 50.0, True),
                                   ("curriculum_ema", "ema", 0.9995, True),
                                   ("promote_min_episodes", "min_episodes", 0, True),
                                   ("curriculum_ema", "ema", 1.0, False),
                                   ("curriculum_target", "target", -0.1, False)):
    d = {"rl": {rl_name: value}}
    if ok:
      rl = run_config_from_dict(d).rl
      assert getattr(rl.curriculum, name) == value
      Curriculum({"a": (0, 2, 1.0)}, rl.curriculum)
    else:
      with pytest.raises(ConfigError, match=f"rl.{rl_name}"):
        run_config_from_dict(d)
      with pytest.raises(ConfigError, match=f"CurriculumSettings.{name}"):
        CurriculumSettings(**{name: value})


def test_cross_field_checks_name_the_field():
  """Checks that relate several fields (a class's check, RunConfig.check) name one field."""
  cur = _plain(load_config("curriculum_cpu"))
  stage = cur["curriculum"]["stages"][0]
  for change, field in (
      (lambda d: d["train"].update(batch_size=6, grad_accum=4), "train.grad_accum"),
      (lambda d: d["mesh"].update(data=-1, fsdp=-1), "mesh"),
      (lambda d: d["compute"].update(kda_chunk_size=stage["seq_len"] * 2),
       "curriculum.stages[0].seq_len"),
      (lambda d: d["train"].update(steps=10 ** 9), "train.steps"),
      (lambda d: d["curriculum"]["stages"][0].update(weights={"nope": 1.0}),
       "curriculum.stages[0].weights"),
      (lambda d: d["curriculum"]["stages"][1].update(seq_len=stage["seq_len"]),
       "curriculum.stages[1].seq_len")):
    d = _plain(load_config("curriculum_cpu"))
    change(d)
    with pytest.raises(ConfigError, match=re.escape(f"config field `{field}` = ")):
      run_config_from_dict(d)
  assert isinstance(run_config_from_dict(cur), RunConfig)
