"""train_and_evaluate on a tiny real model: outputs, resume exactness, corruption, bad input."""

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import types

import jax
import numpy as np
import pytest

from hybridmoe_jax.config import ConfigError, migrate_legacy
from hybridmoe_jax.evals import report
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax import loading
from hybridmoe_jax.train.loop import InputError, train_and_evaluate
from tests.conftest import ROOT, load_config, one_device
from tests._support import tiny_run_config
from tests.train.train_fakes import FakeIterator, train_losses

OLD_RUN = ROOT / "tests" / "testdata" / "run_928f724"  # see its README.md


class Crash(Exception):
  pass


class _Iter(FakeIterator):
  """FakeIterator with a hook called before batch `at` (to crash or signal mid-run)."""

  def __init__(self, *a, at=None, hook=None, **kw):
    super().__init__(*a, **kw)
    self.at, self.hook = at, hook

  def __next__(self):
    if self.at is not None and self.index == self.at:
      self.at = None
      self.hook()
    return super().__next__()


def _data(config, **kw):
  t = config.train
  evals = list(FakeIterator(t.batch_size, t.seq_len, seed=99, length=2))
  return types.SimpleNamespace(train=_Iter(t.batch_size, t.seq_len, **kw), eval_batches=evals)


def _run(config, workdir, **kw):
  data_kw = {k: kw.pop(k) for k in ("at", "hook") if k in kw}
  return train_and_evaluate(run_config_from_dict(config), str(workdir),
                            data=_data(config, **data_kw), **kw)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
  """The default 8-step run, exported: checked end to end, and the reference that the
  crash-and-resume tests must reproduce (each run compiles its own steps)."""
  workdir = tmp_path_factory.mktemp("ref")
  with one_device():
    return workdir, _run(tiny_run_config(profile_steps="2:3"), workdir,
                         export_params_to=str(workdir / "export"))


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
  """A finished 3-step run, copied by the tests that resume or refuse it."""
  workdir = tmp_path_factory.mktemp("three_steps")
  with one_device():
    _run(tiny_run_config(steps=3), workdir)
  return workdir


def test_end_to_end_outputs(ref, tmp_path):
  workdir, s = ref
  assert s["end_step"] == 8 and s["stopped_by"] is None
  assert s["last_loss"] < s["first_loss"]
  assert s["eval"]["bits_per_byte"] > 0 and s["eval"]["tokens"] > 0
  assert s["alerts"]["maxvio"] >= 1          # threshold 0 -> the alert fires
  assert sorted(int(d) for d in os.listdir(workdir / "checkpoints")) == [3, 6, 8]
  assert glob.glob(str(workdir / "tensorboard" / "events.out.tfevents.*"))
  assert (workdir / "expert_load.png").stat().st_size > 5000   # a labelled figure
  # train.profile_steps="2:3": one jax.profiler trace (TensorBoard xplane + Perfetto JSON).
  traces = glob.glob(str(workdir / "profile" / "plugins" / "profile" / "*" / "*"))
  assert any(t.endswith(".xplane.pb") for t in traces), traces
  assert any(t.endswith("trace.json.gz") for t in traces), traces
  # The run report reads this real run: config from the checkpoint, counts, hardware.
  page = open(report.write_report(str(workdir), str(workdir / "report"))).read()
  assert "train.profile_steps" in page and "checkpoints_corrupt" not in page
  assert re.search(r"backend\s*</td><td[^>]*>cpu<", page) and 'class="note"' not in page
  assert len(train_losses(workdir)) == 8
  assert json.load(open(workdir / "model_config.json"))["d_model"] == 16
  exported = loading.load_exported_params(workdir / "export")
  emb = exported["params"]["embed"]["embedding"]
  np.testing.assert_array_equal(emb, s["state"].params["embed"]["embedding"][...])
  assert "routing_biases" in exported
  # Rerunning a finished run restores and does nothing more (on a copy: `ref` is shared).
  shutil.copytree(workdir, tmp_path / "w")
  s2 = _run(tiny_run_config(), tmp_path / "w")
  assert s2["start_step"] == 8 and s2["end_step"] == 8


def test_resume_after_crash_is_exact(ref, tmp_path):
  config = tiny_run_config()
  ref_dir, ref = ref

  def crash():
    raise Crash()

  with pytest.raises(Crash):
    _run(config, tmp_path / "run", at=5, hook=crash)       # dies during step 6
  assert sorted(int(d) for d in os.listdir(tmp_path / "run" / "checkpoints")) == [3]
  res = _run(config, tmp_path / "run")
  assert res["start_step"] == 3 and res["end_step"] == 8
  assert train_losses(tmp_path / "run") == train_losses(ref_dir)
  for a, b in zip(jax.tree.leaves(ref["state"]), jax.tree.leaves(res["state"])):
    np.testing.assert_array_equal(a, b)
  # A fresh run's state is committed to its device as a restored one is: jit keys its
  # programs on that, so the resumed run reused the crashed run's compiled steps.
  leaves = jax.tree.leaves(ref["state"]) + jax.tree.leaves(res["state"])
  assert all(x.committed for x in leaves if isinstance(x, jax.Array))


def test_corrupt_latest_checkpoint_falls_back(ref, tmp_path):
  config = tiny_run_config()
  ref = ref[1]

  def crash():
    raise Crash()

  with pytest.raises(Crash):
    _run(config, tmp_path / "run", at=7, hook=crash)      # checkpoints 3 and 6 written
  # Corrupt step 6's arrays; leave a partial (temporary) step 7 behind.
  for f in glob.glob(str(tmp_path / "run" / "checkpoints" / "6" / "state" / "**" / "d" / "*"),
                     recursive=True):
    os.remove(f)
  os.makedirs(tmp_path / "run" / "checkpoints" / "7.orbax-checkpoint-tmp-1")
  res = _run(config, tmp_path / "run")
  assert res["start_step"] == 3 and res["end_step"] == 8
  corrupt = os.listdir(tmp_path / "run" / "checkpoints_corrupt")
  assert any(c.startswith("6-") for c in corrupt) and any(c.startswith("7.") for c in corrupt)
  for a, b in zip(jax.tree.leaves(ref["state"].params), jax.tree.leaves(res["state"].params)):
    np.testing.assert_array_equal(a, b)


def test_sigint_saves_and_exits(tmp_path):
  config = tiny_run_config(checkpoint_every=100)
  s = _run(config, tmp_path, at=4, hook=lambda: os.kill(os.getpid(), signal.SIGINT))
  assert s["stopped_by"] == "SIGINT" and s["end_step"] == 5
  assert os.listdir(tmp_path / "checkpoints") == ["5"]
  assert signal.getsignal(signal.SIGINT) is not None
  s2 = _run(config, tmp_path)
  assert s2["start_step"] == 5 and s2["end_step"] == 8


def test_incompatible_workdir_is_refused(three_steps, tmp_path):
  shutil.copytree(three_steps, tmp_path, dirs_exist_ok=True)
  config = tiny_run_config(steps=6)
  config.model.d_model = 32
  with pytest.raises(ConfigError, match="d_model"):
    _run(config, tmp_path)
  os.remove(tmp_path / "model_config.json")       # the checkpoint's own copy still catches it
  with pytest.raises(ConfigError, match="d_model"):
    _run(config, tmp_path)
  config = tiny_run_config(steps=6, optimizer="muon")
  with pytest.raises(ConfigError, match="layout"):
    _run(config, tmp_path)


def test_run_saved_before_a_new_config_field_still_resumes(three_steps, tmp_path):
  shutil.copytree(three_steps, tmp_path, dirs_exist_ok=True)
  path = tmp_path / "model_config.json"
  saved = json.loads(path.read_text())
  del saved["vision"]                              # written before vision existed
  saved["moe"].pop("sign_gamma")
  path.write_text(json.dumps(saved))
  s = _run(tiny_run_config(steps=5), tmp_path)
  assert s["start_step"] == 3 and s["end_step"] == 5


def _old_run_config(steps: int):
  """Today's spelling of the config the run in OLD_RUN was made with."""
  config = load_config("tiny")
  config.train.update(dict(steps=steps, batch_size=2, seq_len=32, eval_batches=1,
                           checkpoint_every=0, heatmap_every=0, async_checkpoints=False,
                           log_every=1))
  m = config.model
  config.data.tokenizer, m.vocab_size = "byte", 259   # tiny's vocabulary before issue 48
  m.d_model, m.num_layers = 16, 2
  m.kda.update(dict(num_heads=1, num_v_heads=1, head_dim=16, v_head_dim=16))
  m.mla.update(dict(num_heads=1, kv_lora_rank=16))
  m.moe.update(dict(num_experts=4, experts_per_token=1, expert_intermediate=16,
                    shared_intermediate=16, dense_intermediate=32, latent_dim=0))
  config.compute.kda_chunk_size = 16  # was model.kda.chunk_size
  return config


def test_run_directory_of_older_code_resumes(tmp_path):
  """A workdir written at 928f724 (runtime knobs still in model / train) resumes here."""
  workdir = tmp_path / "run"
  shutil.copytree(OLD_RUN, workdir, ignore=shutil.ignore_patterns("README.md"))
  meta = json.loads((workdir / "checkpoints" / "3" / "meta" / "metadata").read_text())
  saved = json.loads(meta["config"])
  assert "dtype" in saved["model"] and "remat" in saved["train"]  # really the old layout
  old = run_config_from_dict(migrate_legacy(saved))
  new = run_config_from_dict(_old_run_config(steps=3))
  assert old.model == new.model and old.compute == new.compute and old.train == new.train
  s = train_and_evaluate(run_config_from_dict(_old_run_config(steps=5)), str(workdir))
  assert s["start_step"] == 3 and s["end_step"] == 5 and s["stopped_by"] is None
  assert np.isfinite(s["last_loss"])


def test_bad_tokens_stop_before_training(tmp_path):
  config = tiny_run_config()
  data = _data(config)
  data.train.vocab = 100                             # ids up to 99 > vocab_size 64
  with pytest.raises(InputError, match="outside the model vocabulary"):
    train_and_evaluate(run_config_from_dict(config), str(tmp_path), data=data)
  assert not os.listdir(tmp_path / "checkpoints")


def test_empty_dataset_stops(tmp_path):
  config = tiny_run_config()
  data = _data(config)
  data.train.length = 0
  with pytest.raises(InputError, match="empty"):
    train_and_evaluate(run_config_from_dict(config), str(tmp_path), data=data)


def test_existing_export_path_in_a_bucket_is_refused_before_training(tmp_path, monkeypatch):
  """--export_params_to=gs://... that exists: one InputError before the run starts, as for a
  local path (was: found only by the export after training, a FileExistsError traceback)."""
  pytest.importorskip("gcsfs", reason="the cloud extra (gcsfs) is not installed")
  pytest.importorskip("gcp_storage_emulator", reason="the cloud-test extra is not installed")
  from hybridmoe_jax.data import storage
  from hybridmoe_jax.train import lifecycle
  from tests import _support_gcs as emulator

  monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
  monkeypatch.setattr(lifecycle, "open_run", lambda *a, **k: pytest.fail("the run started"))
  config = run_config_from_dict(tiny_run_config())
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(emulator.running())
    except RuntimeError as e:
      pytest.skip(f"the GCS emulator cannot start here: {e}")
    export = f"gs://{emulator.BUCKET}/export"
    storage.as_path(f"{export}/model_config.json").write_text("{}")
    with pytest.raises(InputError, match=f"--export_params_to={export} already exists"):
      train_and_evaluate(config, str(tmp_path / "w"), data=_data(tiny_run_config()),
                         export_params_to=export)
