"""What the CLIs print: clean log lines, the progress bar on a terminal, the TPU probe skip."""

import io
import json
import logging
import os
import sys
import types

from absl import logging as absl_logging
import pytest

from hybridmoe_jax.cli import terminal
from hybridmoe_jax.config.run import default_config
from hybridmoe_jax.train.monitor import Monitor
from tests.train.test_monitor import monitor_metrics, run_monitor


class _Tty(io.StringIO):
  def isatty(self):
    return True


@pytest.fixture(autouse=True)
def info_level():
  """absl's INFO records reach the handlers (the CLI's --verbosity=0 does this)."""
  logger = logging.getLogger("absl")
  old = logger.level
  logger.setLevel(logging.INFO)
  yield
  logger.setLevel(old)


@pytest.fixture(autouse=True)
def installed(monkeypatch):
  """`terminal.install`'s effects undone after each test: its bar closed and unset, its
  handler removed."""
  monkeypatch.setattr(terminal, "_BAR", None)   # restored (None) at teardown
  before = set(logging.getLogger().handlers)
  yield
  if terminal.active_bar() is not None:
    terminal.active_bar().close()
  for h in set(logging.getLogger().handlers) - before:
    logging.getLogger().removeHandler(h)


@pytest.fixture
def tty():
  stream = _Tty()
  terminal.install(stream)
  terminal.active_bar().min_interval = 0.0
  return stream


def test_clean_lines_and_a_bar_on_a_terminal(tty, tmp_path):
  t = default_config().train
  t.update(dict(log_every=5, heatmap_every=0))
  mon = Monitor(str(tmp_path), t, start_step=0, total_steps=10, tokens_seen=lambda s: 64 * s)
  for step in range(1, 11):
    mon.step(step, monitor_metrics(2.0, 0.1))
  absl_logging.warning("disk almost full")
  mon.close()
  out = tty.getvalue()
  lines = [l.split("\r\x1b[K")[-1] for l in out.split("\n") if l.split("\r\x1b[K")[-1]]
  # absl's prefix (I1204 13:37:29.844782 140660088568704 monitor.py:164]) is gone.
  assert lines[0].startswith("step  1/10 | loss 2.0000"), lines
  assert not any(l[:1] in "IWE" and l[1:5].isdigit() for l in lines), lines
  assert "warning: disk almost full" in lines
  # The bar: redrawn in place (\r), at 100 % at the end, with loss, rate and ETA.
  assert out.count("\r\x1b[K") >= 10
  assert "\r\x1b[K100% |########################| 10/10 loss 2.0000 |" in out
  assert "tok/s | ETA 0s" in out


def test_no_bar_when_not_a_terminal(tmp_path):
  stream = io.StringIO()
  terminal.install(stream)
  run_monitor(tmp_path, 5, log_every=5)
  out = stream.getvalue()
  assert "\r" not in out and "%" not in out
  assert [l.split(" | ")[0] for l in out.splitlines()] == ["step 1/5", "step 5/5"]
  # The JSONL is what it was: one record per logged step.
  assert [json.loads(l)["step"] for l in open(tmp_path / "metrics.jsonl")] == [1, 5]


def test_bar_rendering():
  bar = terminal.ProgressBar(io.StringIO(), width=10)
  assert not bar.enabled            # a StringIO is no terminal: nothing is drawn
  bar.update(3, 10, "x")
  assert bar.stream.getvalue() == ""
  assert bar.render(3, 10, "loss 1") == " 30% |###.......| 3/10 loss 1"
  assert bar.render(12, 10) == "100% |##########| 12/10"


class _FakeJax:
  """sys.modules["jax"] as skip_absent_tpu sees it: config.jax_platforms and update."""

  def __init__(self, platforms, updates):
    self.config = types.SimpleNamespace(jax_platforms=platforms,
                                        update=lambda k, v: updates.append((k, v)))


def _fake_root(tmp_path, *, pci=(), dev=()):
  for i, (vendor, device) in enumerate(pci):
    d = tmp_path / "sys" / "bus" / "pci" / "devices" / f"0000:00:0{i}.0"
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "device").write_text(device + "\n")
  for p in dev:
    (tmp_path / "dev" / p).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "dev" / p).write_text("")
  return str(tmp_path)


@pytest.mark.parametrize("pci,dev,expect", [
    ((), (), "cpu"),
    ((("0x1ae0", "0x0042"), ("0x1af4", "0x1041")), (), "cpu"),   # gVNIC, virtio: no TPU
    ((("0x1ae0", "0x0062"),), (), None),                          # a v5p chip
    ((), ("accel0",), None), ((), ("vfio/0",), None),             # TPU device nodes
    ((), ("nvidia0",), None),                                     # a GPU: jax chooses
], ids=["bare", "gce-nic", "tpu-pci", "accel", "vfio", "gpu"])
def test_skip_absent_tpu(tmp_path, monkeypatch, pci, dev, expect):
  monkeypatch.setenv("JAX_PLATFORMS", "")   # restored at teardown: the call sets it
  for k in list(os.environ):
    if k.startswith("TPU_") or k in ("JAX_PLATFORMS", "JAX_FORCE_TPU_INIT"):
      monkeypatch.delenv(k)
  monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")   # what jax's import sets without a TPU
  updates = []
  monkeypatch.setitem(sys.modules, "jax", _FakeJax(None, updates))
  root = _fake_root(tmp_path, pci=pci, dev=dev)
  assert terminal.skip_absent_tpu(root) == expect
  assert os.environ.get("JAX_PLATFORMS") == expect
  assert updates == ([("jax_platforms", "cpu")] if expect else [])


def test_skip_absent_tpu_respects_the_user(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "jax", _FakeJax(None, []))
  monkeypatch.setenv("JAX_PLATFORMS", "")                 # the user's choice, even empty
  assert terminal.skip_absent_tpu(_fake_root(tmp_path)) is None
  assert os.environ["JAX_PLATFORMS"] == ""
  monkeypatch.delenv("JAX_PLATFORMS")
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")     # a TPU VM's environment
  assert terminal.skip_absent_tpu(_fake_root(tmp_path)) is None
  assert "JAX_PLATFORMS" not in os.environ
  monkeypatch.setitem(sys.modules, "jax", _FakeJax("tpu,cpu", []))  # jax's TPU VM init chose
  monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
  assert terminal.skip_absent_tpu(_fake_root(tmp_path)) is None


def test_clean_formatter_levels():
  fmt = terminal.CleanFormatter("%(message)s")
  rec = lambda level: logging.LogRecord("absl", level, "f.py", 1, "msg %d", (3,), None)
  assert [fmt.format(rec(l)) for l in (logging.INFO, logging.WARNING, logging.ERROR)] == [
      "msg 3", "warning: msg 3", "ERROR: msg 3"]
