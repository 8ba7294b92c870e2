"""The dry run's own entry point: `python -m hybridmoe_jax.tools.footprint` prints exactly
what `run_train.py --dry_run` prints (README and BENCHMARKS use the latter), and a bad
override stops with one line."""

import subprocess
import sys

from tests.conftest import ROOT


def _run(*args):
  return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                        timeout=180)


def test_footprint_is_run_train_dry_run():
  tool = _run("-m", "hybridmoe_jax.tools.footprint", "--config.train.batch_size=16")
  main = _run("run_train.py", "--dry_run", "--config.train.batch_size=16")
  assert tool.returncode == main.returncode == 0, tool.stderr + main.stderr
  assert "parameters: total" in tool.stdout and tool.stdout == main.stdout
  bad = _run("-m", "hybridmoe_jax.tools.footprint", "--config.hardware.topology=v5p-7")
  errors = [l for l in bad.stderr.splitlines() if l.startswith("error:")]
  assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
  assert len(errors) == 1 and "hardware.topology" in errors[0], bad.stderr
