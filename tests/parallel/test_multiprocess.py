"""Two local CPU processes (jax.distributed + gloo collectives), 4 simulated devices each:
train on a global (data=2, expert=4) mesh, checkpoint collectively, resume on (data=4,
expert=2). Both processes must report the same losses. Slow (two 2-process runs)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.parallel import distributed
from tests.conftest import ROOT, SUBPROCESS_XLA_FLAGS

RUN = [sys.executable, str(ROOT / "run_train.py")]
_ARGS = ["--config.train.batch_size=4", "--config.train.seq_len=32", "--config.train.warmup=1",
         "--config.train.log_every=1", "--config.train.eval_batches=1",
         "--config.train.heatmap_every=0", "--config.train.async_checkpoints=False",
         "--config.mesh.fsdp=1"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _two_processes(tmp_path, tag, steps, data, expert):
  env = dict(os.environ,
             XLA_FLAGS=f"{SUBPROCESS_XLA_FLAGS} --xla_force_host_platform_device_count=4")
  port = _free_port()
  procs = []
  for pid in range(2):
    log = open(tmp_path / f"{tag}{pid}.log", "w")
    procs.append(subprocess.Popen(
        RUN + _ARGS + [f"--workdir={tmp_path / 'run'}", f"--config.train.steps={steps}",
                       f"--config.mesh.data={data}", f"--config.mesh.expert={expert}",
                       f"--coordinator_address=localhost:{port}", "--num_processes=2",
                       f"--process_id={pid}"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  for p in procs:
    assert p.wait(timeout=900) == 0, (tmp_path / f"{tag}0.log").read_text()[-3000:]
  losses = []
  for pid in range(2):
    text = (tmp_path / f"{tag}{pid}.log").read_text()
    losses.append([l.split("| loss ")[1].split()[0] for l in text.splitlines()
                   if "| loss " in l and "eval step" not in l])
  return losses


@pytest.mark.slow
def test_two_process_train_and_resume_on_another_mesh(tmp_path):
  first = _two_processes(tmp_path, "a", 2, data=2, expert=4)
  assert first[0] == first[1] and len(first[0]) == 2          # one global computation
  resumed = _two_processes(tmp_path, "b", 3, data=4, expert=2)
  assert resumed[0] == resumed[1] and len(resumed[0]) == 1    # only step 3 ran
  rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["step"] for r in rows if r.get("event") == "resume"] == [2]


def test_host_state_roundtrip_single_process():
  state = {"iterator": {"pos": 3}}
  assert distributed.gather_host_states(state) == state
  assert distributed.own_host_state(state) == state
  with pytest.raises(ConfigError, match="2 processes"):
    distributed.own_host_state({"per_process": [state, state]})


def test_distributed_flags_validation():
  assert distributed.initialize() is False
  with pytest.raises(ValueError, match="coordinator_address"):
    distributed.initialize(num_processes=2)
  with pytest.raises(ValueError, match="process_id"):
    distributed.initialize(coordinator_address="localhost:1", num_processes=2, process_id=2)
