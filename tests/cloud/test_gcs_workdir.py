"""A gs:// workdir's pieces against the GCS emulator on 127.0.0.1: the run lock object
(create-if-absent, refusal of a second run, the local lock's stale rules, heartbeat, release)
and the staging directory (rebuilt from the bucket, changed files pushed as whole objects).
The training runs on a gs:// workdir are in test_gcs_training.py."""

import contextlib
import json
import os
import socket
import time

import pytest

pytest.importorskip("gcsfs", reason="the cloud extra (gcsfs) is not installed")
pytest.importorskip("gcp_storage_emulator",
                    reason="the cloud-test extra (gcp-storage-emulator) is not installed")

from hybridmoe_jax.cli import workdir_lock  # noqa: E402
from hybridmoe_jax.cli.errors import InputError, checked_workdir_path  # noqa: E402
from tests import _support_gcs as emulator  # noqa: E402
from hybridmoe_jax.data import storage  # noqa: E402
from hybridmoe_jax.train import remote_workdir  # noqa: E402

B = f"gs://{emulator.BUCKET}"


def _put(url, record):
  storage.as_path(url).write_text(json.dumps(record))


def test_workdir_url_checked():
  assert checked_workdir_path("gs://b/run/") == "gs://b/run"
  for bad in ("gs://b", "s3://b/run"):
    with pytest.raises(InputError, match=r"a cloud workdir is gs://<bucket>/<path>"):
      checked_workdir_path(bad)


def test_lock_object_one_holder_then_released(gcs):
  url = f"{B}/lock1"
  with remote_workdir.BucketLock(url):
    holder = json.loads(storage.as_path(f"{url}/run.lock").read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(workdir_lock.WorkdirBusy, match=rf"^workdir {url} is in use by another "
                       rf"run \(pid {os.getpid()} on host"):
      remote_workdir.BucketLock(url).acquire()
  assert not storage.as_path(f"{url}/run.lock").exists()


def test_stale_lock_rules_and_heartbeat(gcs):
  url = f"{B}/lock2"
  dead = {"host": socket.gethostname(), "pid": 2 ** 22 + 7, "proc_start": "1"}
  _put(f"{url}/run.lock", dead)           # this host, a PID that is not running: stale
  lock = remote_workdir.BucketLock(url, heartbeat_s=0.2)
  with lock:
    names = sorted(p.name for p in storage.as_path(url).iterdir())
    aside = [n for n in names if n.startswith("run.lock.stale-")]
    assert len(aside) == 1                 # the stale record is kept
    assert json.loads(storage.as_path(f"{url}/{aside[0]}").read_text())["pid"] == dead["pid"]
    time.sleep(0.6)                        # the heartbeat refreshes the object's metadata
    lock._read_holder()  # pylint: disable=protected-access
    assert lock._age() < 0.5  # pylint: disable=protected-access
  other = {"host": "elsewhere", "pid": os.getpid()}
  _put(f"{url}/run.lock", other)          # another host with a fresh heartbeat: busy
  with pytest.raises(workdir_lock.WorkdirBusy, match="on host elsewhere"):
    remote_workdir.BucketLock(url).acquire()
  with remote_workdir.BucketLock(url, stale_after_s=0.0):   # ... until it is stale
    assert json.loads(storage.as_path(f"{url}/run.lock").read_text())["host"] != "elsewhere"


def test_staging_rebuilt_from_bucket_and_pushed(gcs, tmp_path):
  url = f"{B}/stage"
  staged = remote_workdir.Staged(url)
  staged.pull()                                     # a new workdir: empty staging
  assert os.listdir(staged.local) == []
  with open(os.path.join(staged.local, "metrics.jsonl"), "w") as f:
    f.write('{"step": 1}\n')
  os.makedirs(os.path.join(staged.local, "tokenizer"))
  with open(os.path.join(staged.local, "tokenizer", "t.json"), "w") as f:
    f.write("{}")
  staged.push()
  with open(os.path.join(staged.local, "metrics.jsonl"), "a") as f:
    f.write('{"step": 2}\n')   # appended locally, then rewritten whole in the bucket
  staged.push()
  assert storage.as_path(f"{url}/metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
  assert storage.as_path(f"{url}/tokenizer/t.json").read_text() == "{}"
  storage.as_path(f"{url}/checkpoints/1/x").write_text("orbax")   # never staged
  storage.as_path(f"{url}/run.lock.stale-1-2").write_text("{}")
  storage.as_path(f"{url}/checkpoints.url").write_text(f"{url}/checkpoints\n")
  with open(os.path.join(staged.local, "metrics.jsonl"), "a") as f:
    f.write('{"step": 3}\n')   # never pushed (a killed run): the bucket is the truth
  with open(os.path.join(staged.local, "stray"), "w") as f:
    f.write("x")
  again = remote_workdir.Staged(url)
  again.pull()
  assert sorted(os.listdir(again.local)) == [".mirror.json", "checkpoints.url",
                                              "metrics.jsonl", "tokenizer"]
  with open(os.path.join(again.local, "metrics.jsonl")) as f:
    assert f.read() == '{"step": 1}\n{"step": 2}\n'


def test_second_run_on_a_held_gs_workdir_is_refused(gcs):
  from hybridmoe_jax.config.run import run_config_from_dict
  from hybridmoe_jax.train.loop import train_and_evaluate
  from tests._support import tiny_run_config
  config = tiny_run_config(steps=1)
  config.model.vocab_size = 272   # the byte tokenizer (with room for its chat roles)
  url = f"{B}/busy"
  with remote_workdir.BucketLock(url):
    with pytest.raises(InputError, match=rf"^workdir {url} is in use by another run"):
      train_and_evaluate(run_config_from_dict(config), url)
  assert not storage.as_path(f"{url}/checkpoints").exists()   # nothing was written


def test_params_export_read_back_from_the_bucket(gcs, tmp_path):
  import dataclasses
  import numpy as np
  from hybridmoe_jax import loading
  from hybridmoe_jax.train.params_export import export_params
  from hybridmoe_jax.train.state import split_model
  from tests._support import tiny_model
  model = tiny_model(layer_kinds=("kda", "mla"))
  _, params, biases, _ = split_model(model)
  cfg = dataclasses.asdict(model.cfg)
  local = export_params(str(tmp_path / "export"), params, biases, cfg)
  export_params(f"{B}/export", params, biases, cfg)      # written locally, then uploaded
  want = loading.load_exported_params(local)
  got = loading.load_exported_params(f"{B}/export")      # through the local mirror
  import jax
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(a, b)
  again, info = loading.load_model(params=f"{B}/export")
  assert again.cfg == model.cfg and info["source"] == "params"
  with pytest.raises(FileNotFoundError, match=rf"^{B}/no-export: no run or params export "):
    loading.load_model(params=f"{B}/no-export")


def test_gs_workdir_in_a_missing_bucket_is_one_line(gcs):
  closing = contextlib.ExitStack()
  with closing, pytest.raises(InputError) as e:
    remote_workdir.open_staged("gs://no-such-bucket/run", closing, stale_after_s=600)
  assert str(e.value) == "gs://no-such-bucket/run: does not exist (cannot lock it)"
