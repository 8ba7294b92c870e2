"""run_train.py on 8 simulated devices: train on (data=2, expert=4), resume on (data=4,
expert=2) and get the same next-step loss as resuming on the original mesh. Slow (3 runs)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

RUN = [sys.executable, str(ROOT / "run_train.py")]
_ARGS = ["--config.train.batch_size=4", "--config.train.seq_len=32", "--config.train.warmup=1",
         "--config.train.log_every=1", "--config.train.eval_batches=1",
         "--config.train.heatmap_every=0", "--config.train.checkpoint_every=1000",
         "--config.mesh.fsdp=1"]


def _run(workdir, steps, data, expert):
  env = dict(os.environ)
  assert "device_count=8" in env.get("XLA_FLAGS", "")
  p = subprocess.run(RUN + _ARGS + [f"--workdir={workdir}", f"--config.train.steps={steps}",
                                    f"--config.mesh.data={data}",
                                    f"--config.mesh.expert={expert}"],
                     capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return {r["step"]: r["loss"] for r in rows if r.get("split") == "train"}


@pytest.mark.slow
def test_resume_on_a_different_mesh(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  first = _run(a, 2, data=2, expert=4)
  assert sorted(first) == [1, 2]
  shutil.copytree(a, b)
  other_mesh = _run(a, 3, data=4, expert=2)[3]
  same_mesh = _run(b, 3, data=2, expert=4)[3]
  assert abs(other_mesh - same_mesh) <= 1e-5 * abs(same_mesh), (other_mesh, same_mesh)


@pytest.mark.slow
def test_cli_bad_mesh_is_one_error_line(tmp_path):
  p = subprocess.run(RUN + ["--config.mesh.data=3", "--workdir=/nonexistent/x"],
                     capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert p.returncode != 0
  err = [l for l in p.stderr.splitlines() if l.startswith("error:")]
  assert len(err) == 1 and "mesh" in err[0] and "8 device" in err[0], p.stderr[-2000:]
