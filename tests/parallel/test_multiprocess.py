"""Two local CPU processes (jax.distributed + gloo collectives), 4 simulated devices each:
train on a global (data=2, expert=4) mesh, checkpoint collectively, resume on (data=4,
expert=2). Both processes must report the same losses. Slow (two 2-process runs).

Per-host input (data.input_shards = 2): each of two processes reads its own documents, the
two batches are disjoint and together are the one-process global batch, and a two-process
run resumed from gathered iterator states continues on the batches it would have seen."""

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
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


def _two_processes(tmp_path, tag, steps, data, expert, extra=()):
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
                       f"--process_id={pid}", *extra],
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


@pytest.mark.slow
def test_two_process_params_export_to_a_bucket(tmp_path, monkeypatch):
  """A two-process run on --workdir=gs://... with --export_params_to=gs://... (the GCS
  emulator on 127.0.0.1): the checkpoints and the export's params/ are written by both
  processes into the bucket, process 0 pushes the run's logs, process 1 its process_1/ logs;
  read back on one device from the bucket, the run's newest checkpoint (what run_eval.py
  and api.load read: its fingerprint holds on another device count) and the export hold the
  same parameters."""
  pytest.importorskip("gcsfs", reason="the cloud extra (gcsfs) is not installed")
  pytest.importorskip("gcp_storage_emulator",
                      reason="the cloud-test extra (gcp-storage-emulator) is not installed")
  import jax
  from flax import nnx
  from hybridmoe_jax import loading
  from hybridmoe_jax.train.state import split_model
  from tests import _support_gcs as emulator
  from hybridmoe_jax.data import storage
  monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
  try:
    ctx = emulator.running()
    ctx.__enter__()
  except RuntimeError as e:
    pytest.skip(f"the GCS emulator cannot start here: {e}")
  try:
    url, workdir = f"gs://{emulator.BUCKET}/mp-export", f"gs://{emulator.BUCKET}/mp-run"
    _two_processes(tmp_path, "x", 1, data=2, expert=4,   # the last --workdir wins
                   extra=[f"--workdir={workdir}", f"--export_params_to={url}"])
    names = {p.name for p in storage.as_path(url).iterdir()}
    assert {"model_config.json", "tokenizer", "params"} <= names
    names = {p.name for p in storage.as_path(workdir).iterdir()}
    assert {"checkpoints", "metrics.jsonl", "model_config.json", "process_1"} <= names
    assert not (tmp_path / "run").exists()
    exported = loading.load_exported_params(url)
    model, info = loading.load_model(workdir=workdir)
    assert info["step"] == 1 and not info["skipped"]
    want = nnx.to_pure_dict(split_model(model)[1])
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(exported["params"]), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  finally:
    ctx.__exit__(None, None, None)


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


HOST_BATCHES = ROOT / "tests" / "parallel" / "host_batches.py"


def _host_batches(tmp_path, mode, nproc):
  env = dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS, JAX_PLATFORMS="cpu",
             PYTHONPATH=str(ROOT))
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, str(HOST_BATCHES), mode, str(tmp_path), str(port),
                             str(nproc), str(pid), str(tmp_path / "docs.jsonl")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for pid in range(nproc)]
  for p in procs:
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out[-3000:]
  return [np.load(tmp_path / f"{mode}_{nproc}_{pid}.npy") for pid in range(nproc)]


def _doc_ids(tokens) -> set[int]:
  text = bytes(int(t) for t in tokens.ravel() if t < 256).decode("utf-8", "replace")
  return {int(m) for m in re.findall(r"<doc (\d+)>", text)}


def _docs(tmp_path):
  (tmp_path / "docs.jsonl").write_text("".join(
      json.dumps({"text": f"<doc {i}> " + "abc " * (i % 6 + 1)}) + "\n" for i in range(60)))


@pytest.mark.slow  # seven process starts with jax.distributed: ~30 s on the 2-core box
def test_two_hosts_read_disjoint_shares_of_the_global_batch_and_resume(tmp_path):
  _docs(tmp_path)
  (one,) = _host_batches(tmp_path, "run", 1)            # [5 steps, 8 rows, T]
  two = _host_batches(tmp_path, "run", 2)               # per process [5, 4, T]
  np.testing.assert_array_equal(np.concatenate(two, axis=1), one)
  assert _doc_ids(two[0]) and not _doc_ids(two[0]) & _doc_ids(two[1])
  first = _host_batches(tmp_path, "first", 2)
  resumed = _host_batches(tmp_path, "resume", 2)
  for pid in range(2):
    np.testing.assert_array_equal(np.concatenate([first[pid], resumed[pid]]), two[pid])
  assert "per_process" in json.loads((tmp_path / "state.json").read_text())


def test_host_input_shards_in_process(tmp_path):
  """The same split without processes: shard_index / shard_count as run_inputs passes them."""
  from hybridmoe_jax.data.pipeline import build_train_and_eval, host_input_shards
  from hybridmoe_jax.config.run import DataConfig
  _docs(tmp_path)
  cfg = DataConfig(source="jsonl", paths=(str(tmp_path / "docs.jsonl"),), input_shards=2)
  def take(rows, index, count, n=3):
    it = build_train_and_eval(cfg, vocab_size=259, seq_len=32, batch_size=rows, seed=5,
                              shard_index=index, shard_count=count).train
    return np.stack([next(it)["tokens"] for _ in range(n)]) if n else None, it
  one, it = take(8, 0, 1)
  halves = [take(4, p, 2)[0] for p in range(2)]
  np.testing.assert_array_equal(np.concatenate(halves, axis=1), one)
  assert not _doc_ids(halves[0]) & _doc_ids(halves[1])
  state = json.loads(json.dumps(it.get_state()))
  again = take(8, 0, 1, n=0)[1]
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["tokens"], next(it)["tokens"])
  with pytest.raises(ConfigError, match="input_shards` = 3 is invalid: allowed a multiple"):
    host_input_shards(3, 4, 0, 2)
  with pytest.raises(ConfigError, match="rows must split evenly over its 4 shards"):
    host_input_shards(4, 6, 0, 1)


def test_curriculum_stages_honour_input_shards(tmp_path):
  """Curriculum stages split by data.input_shards like the data pipeline: two processes'
  batches are disjoint and side by side equal one process's, in both stages, and a state
  saved inside a stage or at the boundary resumes on the same batches."""
  from hybridmoe_jax.config.run import run_config_from_dict
  from hybridmoe_jax.data.curriculum import build_curriculum_data
  from hybridmoe_jax.train import stage_plan
  from tests.conftest import load_config
  (tmp_path / "docs.jsonl").write_text("".join(   # ~200-byte documents: few reads per batch
      json.dumps({"text": f"<doc {i}> " + "abc " * (40 + i % 10)}) + "\n" for i in range(60)))
  config = load_config("tiny")
  config.model.vocab_size = 272
  c = config.curriculum
  c.tokens_per_step, c.num_workers = 512, 0
  c.sources = {"docs": {"kind": "jsonl", "paths": (str(tmp_path / "docs.jsonl"),),
                        "field": "text"}}
  c.stages = (dict(name="a", seq_len=64, steps=2, weights={"docs": 1.0}),
              dict(name="b", seq_len=128, steps=2, weights={"docs": 1.0}))
  config.data.input_shards, config.train.steps, config.train.eval_batches = 2, 4, 1
  run = run_config_from_dict(config)

  def train(index, count):
    return build_curriculum_data(stage_plan.build_plan(run).stages, run.curriculum, run.data,
                                 vocab_size=272, seed=3, eval_batches=1, shard_index=index,
                                 shard_count=count).train
  it, one, states = train(0, 1), [], []
  for _ in range(4):
    states.append(json.loads(json.dumps(it.get_state())))
    one.append(next(it)["tokens"])
  halves = [[next(it)["tokens"] for _ in range(4)] for it in (train(0, 2), train(1, 2))]
  assert [x.shape for x in one] == [(8, 64), (8, 64), (4, 128), (4, 128)]
  for step in range(4):
    np.testing.assert_array_equal(np.concatenate([h[step] for h in halves]), one[step])
    assert not _doc_ids(halves[0][step]) & _doc_ids(halves[1][step])
  again = train(0, 1)
  for step in (1, 2):   # inside stage a, and at the boundary to stage b
    again.set_state(states[step])
    np.testing.assert_array_equal(next(again)["tokens"], one[step])
