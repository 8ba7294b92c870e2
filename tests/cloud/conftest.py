"""The GCS emulator (gcp-storage-emulator on 127.0.0.1) shared by a test module, and a
cache directory of each test's own for remote shards, mirrors and staging directories."""

import pytest

from tests import _support_gcs as emulator
from hybridmoe_jax.data import storage


@pytest.fixture(scope="module")
def gcs():
  try:
    with emulator.running() as url:
      yield url
  except RuntimeError as e:
    pytest.skip(f"the GCS emulator cannot start here: {e}")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
