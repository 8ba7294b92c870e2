"""The startup report of which implementation each layer kind resolves to (and why)."""

import pytest

from hybridmoe_jax.config import ComputeConfig, KDAConfig, ModelConfig
from hybridmoe_jax.model.impls import describe_impls
from hybridmoe_jax.ops.kda import choose


def _kda_line(cfg, compute, backend):
  return next(l for l in describe_impls(cfg, compute, backend=backend) if "(kda)" in l)


def test_auto_resolves_by_backend_and_domain():
  cfg = ModelConfig(kda=KDAConfig(head_dim=32, v_head_dim=32))
  assert choose("auto", head_dim=32, v_head_dim=32, chunk_size=64, lower_bound=-5.0,
                      backend="gpu")[:2] == ("pallas", "Pallas kernel on gpu")
  name, why, *_ = choose("auto", head_dim=32, v_head_dim=32, chunk_size=64,
                           lower_bound=-5.0, backend="cpu")
  assert name == "chunked" and "'cpu'" in why
  # Out of the kernels' domain on an accelerator: the reason is the domain error.
  name, why, *_ = choose("auto", head_dim=24, v_head_dim=32, chunk_size=64,
                           lower_bound=-5.0, backend="tpu")
  assert name == "chunked" and "K=24" in why
  name, why, *_ = choose("auto", head_dim=32, v_head_dim=32, chunk_size=64,
                           lower_bound=None, backend="gpu")
  assert name == "chunked" and "bounded gate" in why
  # TPU: head dims > 128 exceed the kernel's scoped VMEM (libtpu refuses them; measured),
  # e.g. the context runner's state-map pass with values [0 | v] of width K + V.
  name, why, *_ = choose("auto", head_dim=128, v_head_dim=256, chunk_size=64, lower_bound=-5.0,
                     backend="tpu")
  assert name == "chunked" and "VMEM" in why and "V=256" in why
  assert choose("auto", head_dim=128, v_head_dim=128, chunk_size=64, lower_bound=-5.0,
                backend="tpu")[0] == "pallas"
  assert choose("auto", head_dim=128, v_head_dim=256, chunk_size=64, lower_bound=-5.0,
                backend="gpu")[0] == "pallas"
  assert choose("recurrent", head_dim=24, v_head_dim=8, chunk_size=16,
                      lower_bound=None)[:2] == ("recurrent", "requested")
  with pytest.raises(ValueError, match="impl must be one of"):
    choose("flash", head_dim=32, v_head_dim=32, chunk_size=64, lower_bound=-5.0)
  # The model report names the layers and carries the reason.
  line = _kda_line(cfg, ComputeConfig(), "cpu")
  assert line.startswith("layers 0,1,2 (kda): chunked") and "'cpu'" in line
  assert _kda_line(cfg, ComputeConfig(), "gpu").startswith("layers 0,1,2 (kda): pallas")
  unbounded = ModelConfig(kda=KDAConfig(head_dim=32, v_head_dim=32, gate="unbounded"))
  assert "bounded gate" in _kda_line(unbounded, ComputeConfig(), "gpu")


def test_report_covers_every_layer_kind():
  cfg = ModelConfig(num_layers=4)
  lines = describe_impls(cfg, ComputeConfig(moe_impl="dense"), backend="cpu")
  assert [l.split(":")[0] for l in lines] == [
      "layers 0,1,2 (kda)", "layer 3 (mla)", "layers 1,2,3 (moe)"]
  assert "'dense'" in lines[2]
