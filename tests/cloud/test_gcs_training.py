"""A tiny run whose checkpoints live in a bucket (train.checkpoint_dir = gs://..., the
emulator on 127.0.0.1): resumed from the bucket it gives the losses of an uninterrupted local
run, and its params export goes to the bucket byte for byte. Slow: three in-process runs of
the tiny model (~40 s on the 2-core box). The gs:// workdir refusal is fast."""

import pytest

pytest.importorskip("gcsfs", reason="the cloud extra (gcsfs) is not installed")
pytest.importorskip("gcp_storage_emulator",
                    reason="the cloud-test extra (gcp-storage-emulator) is not installed")

from hybridmoe_jax.data import storage  # noqa: E402
from hybridmoe_jax.train.loop import train_and_evaluate  # noqa: E402
from hybridmoe_jax.cli.errors import InputError, checked_workdir_path  # noqa: E402
from hybridmoe_jax.config.run import run_config_from_dict  # noqa: E402
from hybridmoe_jax.data import gcs_emulator as emulator  # noqa: E402
from tests.conftest import one_device  # noqa: E402
from tests._support import tiny_run_config  # noqa: E402
from tests.train.train_fakes import train_losses  # noqa: E402

B = f"gs://{emulator.BUCKET}"


def test_gs_workdir_is_refused_in_one_line():
  with pytest.raises(InputError, match=r"^--workdir=gs://b/run: the workdir .* "
                     r"--config.train.checkpoint_dir=gs://b/run/checkpoints$"):
    checked_workdir_path("gs://b/run")


def _run(workdir, **train):
  config = tiny_run_config(**{**dict(steps=4, checkpoint_every=2, eval_every=0,
                                     heatmap_every=0, async_checkpoints=False), **train})
  config.model.vocab_size = 272   # the byte tokenizer (with room for its chat roles)
  export = train.get("checkpoint_dir") and f"{B}/export-{train['steps']}"
  with one_device():
    train_and_evaluate(run_config_from_dict(config), str(workdir),
                       export_params_to=export or None)
  return train_losses(workdir)


@pytest.mark.slow
def test_checkpoints_in_bucket_resume_exactly_and_export(tmp_path):
  try:
    ctx = emulator.running()
    ctx.__enter__()
  except RuntimeError as e:
    pytest.skip(f"the GCS emulator cannot start here: {e}")
  try:
    local = _run(tmp_path / "local")
    _run(tmp_path / "gcs", steps=2, checkpoint_dir=f"{B}/run/ckpt")
    resumed = _run(tmp_path / "gcs", steps=4, checkpoint_dir=f"{B}/run/ckpt")
    assert resumed == local and len(local) == 4
    steps = sorted(p.name for p in storage.as_path(f"{B}/run/ckpt").iterdir())
    assert steps == ["2", "4"]
    assert not (tmp_path / "gcs" / "checkpoints").exists()
    names = {p.name for p in storage.as_path(f"{B}/export-4").iterdir()}
    assert {"params.safetensors", "model_config.json"} <= names
  finally:
    ctx.__exit__(None, None, None)
