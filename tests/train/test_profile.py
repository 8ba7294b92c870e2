"""train.profile_steps: the "A:B" form, and the trace bracketing exactly steps A..B."""

import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.config.run import TrainConfig, parse_profile_steps
from hybridmoe_jax.train import profile


def test_parse_profile_steps():
  assert parse_profile_steps("") is None
  assert parse_profile_steps("5:5") == (5, 5) and parse_profile_steps("2:10") == (2, 10)
  for bad in ("5", "0:3", "4:2", "a:b", "1:2:3", "-1:2", " : "):
    with pytest.raises(ConfigError, match=r"`train.profile_steps` = .*'A:B'"):
      parse_profile_steps(bad)
  with pytest.raises(ConfigError, match="train.profile_steps"):
    TrainConfig(profile_steps="3-4")


def test_trace_brackets_steps_a_to_b(tmp_path, monkeypatch):
  log = []
  monkeypatch.setattr(profile.jax.profiler, "start_trace",
                      lambda d, **kw: log.append(("start", kw["create_perfetto_trace"])))
  monkeypatch.setattr(profile.jax.profiler, "stop_trace", lambda: log.append(("stop",)))
  monkeypatch.setattr(profile.jax, "block_until_ready", lambda x: log.append(("block", x)))
  prof = profile.StepProfiler("3:4", str(tmp_path), start_step=1)   # resumed at step 1
  step = prof.wrap(lambda state, batch: log.append(("step", state)) or state)
  for n in range(2, 7):
    step(n, None)
  prof.close()                                                     # already stopped: no-op
  assert log == [("step", 2), ("start", True), ("step", 3), ("step", 4), ("block", 4),
                 ("stop",), ("step", 5), ("step", 6)]
  assert (tmp_path / "profile").is_dir()


def test_off_is_the_plain_step_and_close_stops_an_open_trace(tmp_path, monkeypatch):
  fn = lambda s, b: s
  assert profile.StepProfiler("", str(tmp_path), 0).wrap(fn) is fn
  log = []
  monkeypatch.setattr(profile.jax.profiler, "start_trace", lambda d, **kw: log.append("start"))
  monkeypatch.setattr(profile.jax.profiler, "stop_trace", lambda: log.append("stop"))
  prof = profile.StepProfiler("1:100", str(tmp_path), 0)
  prof.wrap(fn)(0, None)
  prof.close()                             # the run stopped (signal, end) inside the window
  assert log == ["start", "stop"]
