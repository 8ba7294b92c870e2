"""Shared test helpers.

The suite runs with 8 simulated CPU devices (set below, before anything imports jax) so that
tests/parallel can build real meshes, with XLA's most costly optimisation passes off and
XLA:CPU's older loop emitters (HYBRIDMOE_TESTS_XLA_OPT=1: XLA's defaults). Every other test
sees a one-device world for meshes: the train loop's mesh uses only the first device and CLI
subprocesses get one device.
All processes of one run (xdist workers, CLI subprocesses) share a persistent JAX compilation
cache in a fresh temporary directory.
"""

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# The user's XLA_FLAGS from before this file added the device count, kept in the environment:
# pytest-xdist workers inherit the controller's already extended XLA_FLAGS.
_SAVED = "HYBRIDMOE_TESTS_USER_XLA_FLAGS"
if _SAVED not in os.environ:
  os.environ[_SAVED] = os.environ.get("XLA_FLAGS", "<unset>")
_USER_XLA_FLAGS = None if os.environ[_SAVED] == "<unset>" else os.environ[_SAVED]

# Tests are dominated by XLA compiles: the suite compiles with most optimisation passes off
# (about 30% less CPU; results are checked against references, not timed). The programs are
# the same; HYBRIDMOE_TESTS_XLA_OPT=1 runs the suite on XLA's defaults. (jaxlib 0.12 dropped
# XLA:CPU's older loop emitters, `--xla_cpu_use_fusion_emitters=false`, which jaxlib 0.10
# compiled the tiny train step with in half the time.)
_COMPILE_FLAGS = ""
if os.environ.get("HYBRIDMOE_TESTS_XLA_OPT") != "1":
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# XLA_FLAGS for processes that must see one device (CLI subprocesses): the user's flags and
# the compile settings above, without the simulated device count.
SUBPROCESS_XLA_FLAGS = f"{_USER_XLA_FLAGS or ''} {_COMPILE_FLAGS}".strip()
os.environ["XLA_FLAGS"] = (SUBPROCESS_XLA_FLAGS if _DEVICE_FLAG in SUBPROCESS_XLA_FLAGS
                           else f"{SUBPROCESS_XLA_FLAGS} {_DEVICE_FLAG}=8".strip())

# One persistent compilation cache for the whole run: the xdist workers and every CLI
# subprocess inherit this directory, so a program compiled once (the tiny model's train
# step, built afresh by each training run) is read back instead of recompiled. A fresh
# temporary directory per run, removed at exit by the process that made it (a
# JAX_COMPILATION_CACHE_DIR already set is used as is and never removed);
# HYBRIDMOE_TESTS_JAX_CACHE=0 turns it off. Only programs that took a second or more to
# compile are written: serialising the many cheap ones costs more than compiling them again
# (tests/layers/test_mixers.py alone: 79 CPU-s with every program written, 64 without them).
if (os.environ.get("HYBRIDMOE_TESTS_JAX_CACHE") != "0"
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ):
  import atexit  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  _cache_dir = tempfile.mkdtemp(prefix="hybridmoe_tests_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

# CPU only, for this process and the CLIs it starts: with jax's CUDA plugin installed (the
# GPU AOT tests' optional extra) and no GPU, every jax start would print the plugin's cuInit
# traceback, which the CLI tests rightly refuse on stderr. Deviceless TPU / GPU topologies
# compile under JAX_PLATFORMS=cpu.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# XLA reads the device count when the backend starts, lazily at the first computation; the
# autouse fixture below removes it from the environment (for subprocesses), so start the
# backend now, with 8 devices, whichever test happens to compute first.
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.devices()

import contextlib
import pathlib  # pylint: disable=g-import-not-at-top,wrong-import-position

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name: str):
  """Load configs/<name>.py and return its get_config() ConfigDict."""
  from hybridmoe_jax.config.flags import load_config_file  # pylint: disable=g-import-not-at-top
  return load_config_file(ROOT / "configs" / f"{name}.py")


@contextlib.contextmanager
def one_device():
  """One device for the meshes built inside (module-scoped fixtures run before the autouse
  fixture below, so they see all the simulated devices)."""
  import jax  # pylint: disable=g-import-not-at-top
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr("hybridmoe_jax.parallel.mesh.available_devices",
               lambda: list(jax.devices())[:1])
    yield


@pytest.fixture(autouse=True)
def _single_device_outside_parallel(request, monkeypatch):
  """Outside tests/parallel, runs see one device, as on a single-device machine."""
  if "parallel" in pathlib.Path(str(request.node.fspath)).parts:
    return
  if SUBPROCESS_XLA_FLAGS:
    monkeypatch.setenv("XLA_FLAGS", SUBPROCESS_XLA_FLAGS)   # subprocesses: one CPU device
  else:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
  import jax  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr("hybridmoe_jax.parallel.mesh.available_devices",
                      lambda: list(jax.devices())[:1])


# Every program XLA:CPU compiles stays mapped (three memory mappings per code object) while a
# jit cache holds it, and a worker runs ~500 tests: past the kernel's vm.max_map_count
# (65,530 by default) the next compile's mmap fails and XLA segfaults. Drop the compiled
# programs whenever a worker holds a third of that (the persistent cache above serves any
# program needed again).
def _map_count_limit() -> int | None:
  try:
    return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text()) // 3
  except (OSError, ValueError):   # not Linux
    return None


_MAP_LIMIT = _map_count_limit()


def pytest_runtest_teardown(item, nextitem):  # pylint: disable=unused-argument
  if _MAP_LIMIT is None:
    return
  with open("/proc/self/maps", "rb") as f:
    mappings = f.read().count(b"\n")
  if mappings > _MAP_LIMIT:
    import gc  # pylint: disable=g-import-not-at-top
    jax.clear_caches()
    gc.collect()
