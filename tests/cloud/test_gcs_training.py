"""Tiny runs against a bucket (the emulator on 127.0.0.1): checkpoints in it
(train.checkpoint_dir = gs://...) with a local workdir, and a whole gs:// --workdir resumed
on a fresh machine after a SIGKILL (another cache dir, the dead run's lock taken over). Each resumed run gives the losses of an
uninterrupted local run; params exports go to the bucket and are read back from it. Slow:
in-process runs of the tiny model (~40 s each test on the 2-core box)."""

import pytest

pytest.importorskip("gcsfs", reason="the cloud extra (gcsfs) is not installed")
pytest.importorskip("gcp_storage_emulator",
                    reason="the cloud-test extra (gcp-storage-emulator) is not installed")

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from hybridmoe_jax import loading  # noqa: E402
from hybridmoe_jax.config.run import run_config_from_dict  # noqa: E402
from tests import _support_gcs as emulator  # noqa: E402
from hybridmoe_jax.data import storage  # noqa: E402
from hybridmoe_jax.train import remote_workdir  # noqa: E402
from hybridmoe_jax.train.loop import train_and_evaluate  # noqa: E402
from hybridmoe_jax.train.state import split_model  # noqa: E402
from hybridmoe_jax.tools import evaluate  # noqa: E402
from tests.conftest import ROOT, SUBPROCESS_XLA_FLAGS, one_device  # noqa: E402
from tests._support import tiny_run_config  # noqa: E402
from tests.train.train_fakes import train_losses  # noqa: E402

B = f"gs://{emulator.BUCKET}"


def _run(workdir, **train):
  config = tiny_run_config(**{**dict(steps=4, checkpoint_every=2, eval_every=0,
                                     heatmap_every=0, async_checkpoints=False), **train})
  config.model.vocab_size = 272   # the byte tokenizer (with room for its chat roles)
  export = ((f"{workdir}-" if "://" in str(workdir) else f"{B}/") + f"export-{train['steps']}"
            if train.get("checkpoint_dir") or "://" in str(workdir) else None)
  with one_device():
    train_and_evaluate(run_config_from_dict(config), str(workdir),
                       export_params_to=export or None)
  return train_losses(loading.local_dir(str(workdir)))   # a gs:// one: its local mirror


@pytest.mark.slow
def test_checkpoints_in_bucket_resume_exactly_and_export(gcs, tmp_path):
  local = _run(tmp_path / "local")
  _run(tmp_path / "gcs", steps=2, checkpoint_dir=f"{B}/run/ckpt")
  resumed = _run(tmp_path / "gcs", steps=4, checkpoint_dir=f"{B}/run/ckpt")
  assert resumed == local and len(local) == 4
  steps = sorted(p.name for p in storage.as_path(f"{B}/run/ckpt").iterdir())
  assert steps == ["2", "4"]
  assert not (tmp_path / "gcs" / "checkpoints").exists()
  names = {p.name for p in storage.as_path(f"{B}/export-4").iterdir()}
  assert {"params.safetensors", "model_config.json"} <= names


# The first machine: trains toward step 4 on a gs:// workdir and is SIGKILLed as soon as
# checkpoint step 2 is committed in the bucket (its staging dir and lock object left behind).
_KILLED = textwrap.dedent("""
    import faulthandler; faulthandler.dump_traceback_later(300, exit=True)
    import os, signal, sys, threading, time
    from hybridmoe_jax.config.run import run_config_from_dict
    from hybridmoe_jax.data import storage
    from hybridmoe_jax.train.loop import train_and_evaluate
    from tests._support import tiny_run_config
    url = sys.argv[1]
    def watchdog():
      while not storage.as_path(url + "/checkpoints/2/commit_success.txt").exists():
        time.sleep(0.01)
      print("killed after step 2", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watchdog, daemon=True).start()
    config = tiny_run_config(steps=4, checkpoint_every=2, eval_every=0, heatmap_every=0,
                             async_checkpoints=False)
    config.model.vocab_size = 272
    train_and_evaluate(run_config_from_dict(config), url)
""")


@pytest.mark.slow
def test_gs_workdir_resumes_from_the_bucket_alone(gcs, tmp_path):
  url = f"{B}/wd"
  local = _run(tmp_path / "local")
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": SUBPROCESS_XLA_FLAGS, storage.CACHE_ENV: str(tmp_path / "machine1")}
  proc = subprocess.run([sys.executable, "-c", _KILLED, url], cwd=ROOT, env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
  assert proc.returncode == -9 and "killed after step 2" in proc.stdout, proc.stdout[-3000:]
  assert storage.as_path(f"{url}/run.lock").exists()       # left by the killed run
  assert not remote_workdir.staging_dir(url).exists()     # this machine has no staging dir
  resumed = _run(url, steps=4)     # takes the dead run's lock over; metrics from the bucket
  assert resumed == local and len(local) == 4
  names = {p.name for p in storage.as_path(url).iterdir()}
  assert {"checkpoints", "model_config.json", "metrics.jsonl", "checkpoints.url",
          "inputs.json", "tensorboard"} <= names and "run.lock" not in names
  assert sum(n.startswith("run.lock.stale-") for n in names) == 1   # the dead run's record
  events = [p.name for p in storage.as_path(f"{url}/tensorboard").iterdir()]
  assert len(events) == 2 and all(n.startswith("events.out.tfevents") for n in events)
  assert sorted(p.name for p in storage.as_path(f"{url}/checkpoints").iterdir()) == ["2", "4"]
  lines = []                              # run_eval.py --task=report: into the bucket
  evaluate.main(task="report", workdir=url, params=None, output_dir=None, config=None,
                option_values={}, echo=lines.append)
  assert lines == [f"report: {url}/report.html"] and storage.as_path(lines[0][8:]).exists()
  model, _, info = loading.load(url)      # what api.load and run_eval.py read
  assert info["layout"] == "workdir" and info["step"] == 4
  mirror = loading.local_dir(url)         # the run's small files; checkpoints stay in the bucket
  assert (open(f"{mirror}/checkpoints.url").read().strip() == f"{url}/checkpoints"
          and not os.path.exists(f"{mirror}/checkpoints"))
  exported = loading.load_exported_params(f"{url}-export-4")
  params = nnx.to_pure_dict(split_model(model)[1])   # the bucket's step 4 = its export
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(exported["params"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)
