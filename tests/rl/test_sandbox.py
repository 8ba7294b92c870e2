"""The sandbox contains runaway code (each case ends with reward 0 and the caller goes on)
and runs honest code normally. Limits are short (1 CPU s, 2 s wall) to keep this fast."""

import dataclasses
import os
import tempfile
import uuid
import warnings

import pytest

from hybridmoe_jax.rl import sandbox, sandbox_boot
from hybridmoe_jax.rl.sandbox import SandboxLimits, run_calls, run_python

FAST = SandboxLimits(timeout_s=2.0, cpu_s=1, memory_mb=256)


def _double_calls():
  return [("double", [3]), ("double", [-4])], [6, -8]


def test_honest_code_runs_and_passes():
  r = run_python("import json\nprint(json.dumps([1, 2]))", FAST)
  assert r.killed is None and r.exit_code == 0 and r.stdout_tail == "[1, 2]\n"
  calls, want = _double_calls()
  res = run_calls("def double(x):\n  return 2 * x\n", calls, want, FAST)
  assert res.passed == (True, True) and res.pass_rate == 1.0 and res.total == 2


def test_writes_inside_the_dir_are_allowed_and_the_dir_is_removed(tmp_path, monkeypatch):
  src = ("import os, pathlib\npathlib.Path('p.txt').write_text('x')\n"
         "open('a.txt', 'w').write('x')\nos.mkdir('d')\n"
         "os.rename('a.txt', 'd/b.txt')\nos.remove('d/b.txt')\nprint(os.getcwd())")
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # where the run's host dir goes
  r = run_python(src, FAST)
  # Namespaced: the cwd is the run's own tmpfs, /sandbox, gone with the run.
  assert r.killed is None and r.stdout_tail == "/sandbox\n", r.stderr_tail
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    r = run_python(src, dataclasses.replace(FAST, isolation="audit-hook"))
  assert r.killed is None, r.stderr_tail
  assert r.stdout_tail.startswith(str(tmp_path)) and not os.path.exists(r.stdout_tail.strip())
  assert os.listdir(tmp_path) == []


def test_wrong_and_faked_results_fail():
  calls, want = _double_calls()
  assert run_calls("def double(x):\n  return 2 * x + 1\n", calls, want, FAST).passed == \
      (False, False)
  # An object that claims equality with anything is not JSON: the call fails.
  fake = "class A:\n  def __eq__(self, o): return True\ndef double(x):\n  return A()\n"
  assert run_calls(fake, calls, want, FAST).passed == (False, False)
  # Printing lines that look like the harness's cannot pass (the nonce and values differ).
  forged = "print('0 0 6')\ndef double(x):\n  raise ValueError\n"
  assert run_calls(forged, calls, want, FAST).num_passed == 0
  # A mutated input does not leak into the next call.
  mut = "def double(x):\n  return 2 * x\n"
  assert run_calls(mut, [("double", [[1]])], [[1, 1]], FAST).passed == (True,)


@pytest.mark.parametrize("index, value", [("\u00b2", "6"), ("0", "[" * 100000 + "]" * 100000)])
def test_forged_lines_with_the_nonce_fail_without_raising(index, value):
  """The nonce is readable inside (job.json): a line forged with it, an index int() refuses
  ('²' is isdigit) or a value nested past json's depth, fails its call, never raises."""
  calls, want = _double_calls()
  src = ("import json\nnonce = json.load(open('job.json'))['nonce']\n"
         f"print(nonce, {index!r}, {value!r})\ndef double(x):\n  return 2 * x\n")
  res = run_calls(src, calls, want, FAST)
  assert res.run.killed is None, res.run.stderr_tail
  assert res.passed == ((False, True) if index == "0" else (True, True))


CONTAINED = {
    "infinite_loop": ("while True:\n  pass\n", ("cpu", "timeout")),
    "sleep_past_wall_clock": ("import time\ntime.sleep(30)\n", ("timeout",)),  # 1 s wall
    "memory_bomb": ("a = []\nwhile True:\n  a.append(' ' * 10**7)\n", ("memory",)),
    "fork_bomb": ("import os\nwhile True:\n  os.fork()\n", ("violation",)),
    "fork_caught": ("import os\ntry:\n  os.fork()\nexcept Exception:\n  pass\n", ("violation",)),
    "subprocess": ("import subprocess\nsubprocess.run(['true'])\n", ("violation",)),
    "os_system": ("import os\nos.system('true')\n", ("violation",)),
    "socket": ("import socket\nsocket.socket().connect(('127.0.0.1', 9))\n", ("violation",)),
    "ctypes": ("import ctypes\n", ("violation",)),
    "output_flood": ("while True:\n  print('x' * 100000)\n", ("output",)),
}

# Cases whose own limit must be the one that ends them: the sleep needs a short wall clock;
# touching 256 MB can cost over a CPU-second of page reclaim on a loaded machine (charged to
# the process as system time), so the memory bomb gets CPU time to spare.
CASE_LIMITS = {
    "sleep_past_wall_clock": SandboxLimits(timeout_s=1.0),
    "memory_bomb": SandboxLimits(timeout_s=20.0, cpu_s=20, memory_mb=256),
}


@pytest.mark.parametrize("case", sorted(CONTAINED))
def test_runaway_code_is_contained_with_reward_zero(case):
  body, kinds = CONTAINED[case]
  calls, want = _double_calls()
  limits = CASE_LIMITS.get(case, FAST)
  res = run_calls(body + "def double(x):\n  return 2 * x\n", calls, want, limits)
  assert res.run.killed in kinds, (res.run.killed, res.run.detail, res.run.stderr_tail)
  assert res.pass_rate == 0.0
  assert res.run.wall_s < limits.timeout_s + 1.5
  # ... and the caller goes on: the next run is normal.
  assert run_python("print(1)", FAST).stdout_tail == "1\n"


@pytest.mark.parametrize("how", [
    "open({path!r}, 'w').write('x')",
    "open('../' * 30 + {path!r}.lstrip('/'), 'w').write('x')",
    "import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))",
    "import os\nos._exit = lambda c: None\nopen({path!r}, 'a').write('x')",  # patched os
    "import os\nos.chdir('/tmp')\nopen({path!r}.rsplit('/', 1)[1], 'w').write('x')",
])
def test_writes_outside_the_dir_are_refused(tmp_path, how):
  path = str(tmp_path / f"escape_{uuid.uuid4().hex}.txt")
  r = run_python(how.format(path=path), FAST)
  assert r.killed == "violation" and "[sandbox] denied" in r.detail, r.stderr_tail
  assert not os.path.exists(path)


def test_deleting_outside_the_dir_is_refused(tmp_path):
  victim = tmp_path / "keep.txt"
  victim.write_text("data")
  for how in (f"import os\nos.remove({str(victim)!r})",
              f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
              f"import shutil\nshutil.rmtree({str(tmp_path)!r})"):
    r = run_python(how, FAST)
    # The audit hook refuses, or (namespaces) the path is not in the run's view at all.
    assert r.killed in ("violation", "error"), (how, r.stderr_tail)
  assert victim.read_text() == "data"


def test_errors_are_classified_and_limits_checked():
  r = run_python("raise ValueError('boom')", FAST)
  assert r.killed == "error" and r.detail == "ValueError: boom"
  assert sandbox.VIOLATION_EXIT == sandbox_boot.VIOLATION_EXIT
  for bad in (dict(timeout_s=0), dict(cpu_s=0), dict(memory_mb=8), dict(max_procs=-1),
              dict(cpu_s=1.5), dict(file_size_mb=True)):
    with pytest.raises(ValueError, match=f"`SandboxLimits.{next(iter(bad))}` = "):
      SandboxLimits(**bad)
  with pytest.raises(ValueError, match="2 calls but 1 expected"):
    run_calls("", [("f", []), ("f", [])], [1], FAST)
