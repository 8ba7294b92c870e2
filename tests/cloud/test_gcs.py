"""gs:// paths against a real GCS API on 127.0.0.1 (gcp-storage-emulator, started here):
prepared shards written to and read from a bucket, Parquet from a bucket, orbax checkpoints
saved, resumed and listed from a bucket (the workdir records where), a writer killed during
a checkpoint upload leaving the previous step intact, and one line for a missing bucket,
missing credentials and unreachable storage."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("gcsfs", reason="the cloud extra (gcsfs) is not installed")
pytest.importorskip("gcp_storage_emulator",
                    reason="the cloud-test extra (gcp-storage-emulator) is not installed")
pytest.importorskip("array_record", reason="the data extra (array-record) is not installed")

import jax.numpy as jnp  # noqa: E402

from hybridmoe_jax.data import prepare as prepare_lib  # noqa: E402
from hybridmoe_jax.data import sources as sources_lib  # noqa: E402
from hybridmoe_jax.data import storage  # noqa: E402
from hybridmoe_jax.train import checkpoint as ckpt_lib  # noqa: E402
from tests import _support_gcs as emulator  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

B = f"gs://{emulator.BUCKET}"
DOCS = [f"cloud doc {i} " + "x" * (i % 13 + 1) for i in range(25)]


def test_prepare_to_bucket_and_read_shards(gcs, tmp_path):
  jsonl = tmp_path / "c.jsonl"
  jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
  prepare_lib.prepare([str(jsonl)], f"{B}/shards", "byte", docs_per_shard=10, progress=None)
  names = sorted(p.name for p in storage.as_path(f"{B}/shards").iterdir())
  assert {"index.json", "prepare.json", "shard-00002.array_record",
          "shard-00002.json"} <= set(names)
  local = tmp_path / "local"
  prepare_lib.prepare([str(jsonl)], str(local), "byte", docs_per_shard=10, progress=None)
  for k in range(3):  # the bucket holds the bytes a local prepare writes
    name = prepare_lib.shard_name(k)
    assert storage.as_path(f"{B}/shards/{name}").read_bytes() == (local / name).read_bytes()
  for paths in ([f"{B}/shards"], [f"{B}/shards/shard-*.array_record"]):
    src = sources_lib.make_source("arrayrecord", paths)
    ref = sources_lib.make_source("arrayrecord", [str(local)])
    assert len(src) == len(DOCS)
    for i in (0, 11, 24):
      np.testing.assert_array_equal(src[i], ref[i])


def test_parquet_from_bucket(gcs, tmp_path):
  pa = pytest.importorskip("pyarrow", reason="the data extra (pyarrow) is not installed")
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"text": DOCS}), str(tmp_path / "t.parquet"), row_group_size=8)
  storage.as_path(f"{B}/pq/t.parquet").write_bytes((tmp_path / "t.parquet").read_bytes())
  src = sources_lib.make_source("parquet", [f"{B}/pq"])
  assert [src[i] for i in range(len(src))] == DOCS


def _state(scale):
  return {"w": jnp.arange(16.0) * scale, "b": jnp.ones((3,)) * scale}


def test_checkpoints_in_a_bucket_save_and_resume(gcs, tmp_path):
  workdir = tmp_path / "run"
  ck = ckpt_lib.Checkpointer(str(workdir), async_save=False, directory=f"{B}/run1/ckpt")
  assert ck.save(1, _state(1.0), {"pos": 1}, {"model_config": {}})
  assert ck.save(2, _state(2.0), {"pos": 2}, {"model_config": {}})
  ck.close()
  assert (workdir / ckpt_lib.LOCATION_FILE).read_text().strip() == f"{B}/run1/ckpt"
  again = ckpt_lib.Checkpointer(str(workdir), async_save=False)  # found through the workdir
  assert again.directory == f"{B}/run1/ckpt" and again.manager.all_steps() == [1, 2]
  abstract = jax_abstract(_state(0.0))
  r = again.restore_latest(abstract, {})
  assert r.meta["step"] == 2 and r.data_state == {"pos": 2}
  np.testing.assert_array_equal(r.state["w"], _state(2.0)["w"])
  again.close()
  with pytest.raises(ckpt_lib.ConfigError, match="are in 'gs://hm-test/run1/ckpt'"):
    ckpt_lib.Checkpointer(str(workdir), directory=f"{B}/elsewhere")


def jax_abstract(tree):
  import jax
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# Saves step 1, then step 2 (192 MB); a watchdog thread SIGKILLs the process as soon as
# step 2's objects start to appear in the bucket and before its commit marker: a kill in
# the middle of the upload, whatever the machine's speed.
_WRITER = textwrap.dedent("""
    import faulthandler; faulthandler.dump_traceback_later(120, exit=True)
    import os, signal, sys, threading, time
    import jax.numpy as jnp
    from hybridmoe_jax.data import storage
    from hybridmoe_jax.train import checkpoint as ckpt_lib
    workdir, directory = sys.argv[1:3]
    ck = ckpt_lib.Checkpointer(workdir, async_save=False, directory=directory)
    ck.save(1, {"w": jnp.arange(16.0), "big": jnp.zeros((4,))}, {"pos": 1}, {"model_config": {}})
    print("step 1 saved", flush=True)
    def watchdog():
      step2 = storage.as_path(directory + "/2")
      while not step2.exists():
        time.sleep(0.005)
      if not (step2 / "commit_success.txt").exists():
        print("killing mid-upload", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watchdog, daemon=True).start()
    ck.save(2, {"w": jnp.arange(16.0) * 2, "big": jnp.ones((48 << 20,))}, {"pos": 2},
            {"model_config": {}})
    print("step 2 saved", flush=True)
""")


def _hashes(prefix):
  fs, root = storage.fsspec_for(prefix)
  return {p[len(root):]: hashlib.sha256(fs.cat_file(p)).hexdigest()
          for p in fs.find(root)}


@pytest.fixture
def fresh_gcs():
  """An emulator of its own, so the killed writer's half-written objects and connections
  cannot touch the other tests' bucket (nor theirs this one)."""
  try:
    with emulator.running() as url:
      yield url
  except RuntimeError as e:
    pytest.skip(f"the GCS emulator cannot start here: {e}")


def test_kill_during_checkpoint_upload_keeps_previous_step(fresh_gcs, tmp_path):
  workdir, directory = tmp_path / "run", f"{B}/killed/ckpt"
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(workdir), directory], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == -9 and "killing mid-upload" in out, out[-2000:]
  assert "step 2 saved" not in out
  before = _hashes(f"{directory}/1")
  assert storage.as_path(f"{directory}/2").exists()       # step 2 was partly uploaded
  assert not storage.as_path(f"{directory}/2/commit_success.txt").exists()
  ck = ckpt_lib.Checkpointer(str(workdir), async_save=False)   # the next run
  r = ck.restore_latest(jax_abstract({"w": jnp.zeros(16), "big": jnp.zeros((4,))}), {})
  assert r.meta["step"] == 1 and r.data_state == {"pos": 1}
  np.testing.assert_array_equal(r.state["w"], np.arange(16.0))
  ck.close()
  assert _hashes(f"{directory}/1") == before     # the previous step is untouched
  assert not storage.as_path(f"{directory}/2").exists()   # set aside, not deleted:
  assert any(p.name.startswith("2-") for p in storage.as_path(f"{directory}_corrupt").iterdir())


def test_missing_bucket_and_credentials_one_line(gcs, tmp_path):
  with pytest.raises(FileNotFoundError, match=r"^data path 'gs://no-such-bucket/x' does not "
                     "exist$"):
    sources_lib.make_source("arrayrecord", ["gs://no-such-bucket/x"])
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    ckpt_lib.Checkpointer(str(tmp_path / "w"), directory="gs://no-such-bucket/ckpt")
  assert "\n" not in str(e.value) and "gs://no-such-bucket/ckpt" in str(e.value)
  google_auth = pytest.importorskip("google.auth", reason="google-auth is not installed")
  os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = str(tmp_path / "missing.json")
  try:
    google_auth.default()
  except Exception as err:  # pylint: disable=broad-except  # the real exception type
    msg = str(storage.storage_error("gs://b/x", err))
  finally:
    del os.environ["GOOGLE_APPLICATION_CREDENTIALS"]
  assert msg.startswith("gs://b/x: cannot read it: no credentials") and "\n" not in msg


@pytest.mark.slow  # gcsfs retries an unreachable host for ~35 s before giving up
def test_unreachable_storage_one_line(monkeypatch):
  pytest.importorskip("gcsfs", reason="the cloud extra (gcsfs) is not installed")
  port = emulator.free_port()   # nothing listens there
  for k, v in emulator.env_for(f"http://127.0.0.1:{port}").items():
    monkeypatch.setenv(k, v)
  emulator._reset_clients()  # pylint: disable=protected-access
  with pytest.raises(ConnectionError, match=f"^gs://b/x: cannot list it: http://127.0.0.1:{port} "
                     "is unreachable"):
    storage.list_files(["gs://b/x"], None)
  emulator._reset_clients()  # pylint: disable=protected-access
