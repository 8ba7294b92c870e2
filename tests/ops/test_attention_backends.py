"""Accelerator attention cores == the dense reference (Pallas kernels interpreted on CPU),
and the resolver's every branch (backends passed by name)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, MLAConfig, ModelConfig
from hybridmoe_jax.layers.mla import MLALayer
from hybridmoe_jax.model.impls import describe_impls, log_impls
from hybridmoe_jax.ops.attention import api as ab
from hybridmoe_jax.ops.attention import triton as triton_core
from hybridmoe_jax.ops.attention.reference import attention_reference
from hybridmoe_jax.train import dry_run
from tests._support import rel_err
from tests.ops.attention_helpers import (attention_inputs, packed_segments,
                                        value_and_grads)


def _inputs(seed, b, t, h, hk, d, dv, dtype=jnp.float32):
  return attention_inputs(seed, b, t, t, h, hk, d, dv, dtype)


def _reference(seg, scale=None):
  kw = {} if seg is None else dict(q_segment_ids=seg, kv_segment_ids=seg)
  return lambda q, k, v: attention_reference(q, k, v, scale=scale, **kw)


def _assert_matches(got, ref, tol):
  for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
    assert a.shape == r.shape and a.dtype == r.dtype, name
    assert rel_err(a, r) < tol, (name, rel_err(a, r))


# ------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("b,t,h,hk,d,dv,block,packed", [
    (2, 45, 2, 2, 24, 16, 16, True),   # T not a multiple of the tile: padded; Dv < D: padded
    (1, 64, 4, 2, 16, 32, 32, False),  # grouped heads (k, v repeated); Dv > D; exact tiles
])
def test_triton_interpret_matches_reference(b, t, h, hk, d, dv, block, packed):
  q, k, v, w = _inputs(t, b, t, h, hk, d, dv)
  seg = packed_segments(t, b, t) if packed else None
  got = value_and_grads(lambda *a: ab.triton_attention(
      *a, segment_ids=seg, scale=0.3, block=block, block_bwd=16, interpret=True), q, k, v, w)
  _assert_matches(got, value_and_grads(_reference(seg, 0.3), q, k, v, w), 1e-5)


@pytest.mark.parametrize("b,t,h,hk,d,dv,packed", [
    (2, 40, 2, 1, 24, 16, True),      # MQA (the absorbed MLA's one shared head), padded T
    (1, 130, 2, 2, 16, 16, False),    # grouped form, two tiles with the second padded
])
def test_splash_interpret_matches_reference(b, t, h, hk, d, dv, packed):
  q, k, v, w = _inputs(t, b, t, h, hk, d, dv)
  seg = packed_segments(t, b, t) if packed else None
  got = value_and_grads(lambda *a: ab.splash_attention(*a, segment_ids=seg, interpret=True),
                         q, k, v, w)
  _assert_matches(got, value_and_grads(_reference(seg), q, k, v, w), 1e-5)


def test_kernels_bfloat16_forward():
  """bf16 in, bf16 out, within bf16 rounding of the fp32 reference (splash scales q first)."""
  q, k, v, _ = _inputs(1, 1, 70, 2, 1, 24, 16, jnp.bfloat16)
  seg = packed_segments(1, 1, 70)
  ref = _reference(seg)(*(x.astype(jnp.float32) for x in (q, k, v)))
  for out in (ab.triton_attention(q, k, v, segment_ids=seg, block=16, interpret=True),
              ab.splash_attention(q, k, v, segment_ids=seg, interpret=True)):
    assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < 1e-2


def test_cudnn_wrapper_argument_mapping_through_xla():
  """The cuDNN call needs a GPU; its argument mapping (head-dim padding to a multiple of 8,
  grouped heads, scale, causal) is the same through implementation="xla"."""
  q, k, v, w = _inputs(0, 2, 37, 4, 2, 12, 6)
  got = value_and_grads(lambda *a: ab.cudnn_attention(*a, scale=0.25, implementation="xla"),
                         q, k, v, w)
  _assert_matches(got, value_and_grads(_reference(None, 0.25), q, k, v, w), 1e-5)
  with pytest.raises(NotImplementedError, match="segment ids"):
    ab.cudnn_attention(q, k, v, segment_ids=packed_segments(0, 2, 37), implementation="xla")


def test_wrappers_reject_bad_input():
  q, k, v, _ = _inputs(0, 1, 16, 3, 2, 8, 8)
  for fn in (ab.triton_attention, ab.splash_attention, ab.cudnn_attention):
    with pytest.raises(ValueError, match="multiple of key/value heads"):
      fn(q, k, v)
  q, k, v, _ = _inputs(0, 1, 16, 2, 2, 8, 8)
  with pytest.raises(ValueError, match="Tq == Tk"):
    ab.triton_attention(q[:, :8], k, v, interpret=True)
  with pytest.raises(ValueError, match="segment ids must be"):
    ab.splash_attention(q, k, v, segment_ids=jnp.ones((1, 15), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="attention core 'flash'"):
    ab.attend("flash", q, k, v, segment_ids=None, scale=1.0, block=16)


def test_tiles():
  assert triton_core._triton_tile(128, 45) == 64 and triton_core._triton_tile(24, 1000) == 16
  assert triton_core._triton_tile(8, 5) == 16 and triton_core._triton_tile(128, 4096) == 128
  assert ab.cudnn_head_dim(192, 128) == 192 and ab.cudnn_head_dim(12, 6) == 16
  assert ab.current_backend() == ("cpu", None)


# ------------------------------------------------------------------------------ resolver
def _resolve(impl, backend, *, dtype="bfloat16", has_segments=False, d=192, dv=128,
             capability=None, seq_len=1024, interpret=False):
  return ab.resolve_impl(impl, backend=backend, seq_len=seq_len, block=128, head_dim=d,
                         v_head_dim=dv, dtype=dtype, has_segments=has_segments,
                         compute_capability=capability, interpret=interpret)


def test_auto_picks_by_backend_with_reasons():
  # CPU: the XLA cost rule.
  assert _resolve("auto", "cpu", seq_len=512)[0] == "dense"
  name, why = _resolve("auto", "cpu", seq_len=513)
  assert name == "blockwise" and "'auto' on cpu" in why and "513 > 4 x" in why
  # TPU: splash whatever T, segments included; fp16 falls back with the reason.
  assert _resolve("auto", "tpu", has_segments=True, seq_len=64)[0] == "splash"
  name, why = _resolve("auto", "tpu", dtype="float16")
  assert name == "blockwise" and "falls back" in why and "splash needs" in why
  # GPU: cudnn when unpacked bf16 within its head-dim limit (256 from Hopper on).
  assert _resolve("auto", "gpu", capability="9.0") == ("cudnn", "compute.mla_impl='auto' "
                                                       "on gpu: cudnn")
  for kw, reason in [(dict(has_segments=True, capability="9.0"), "packed segment ids"),
                     (dict(dtype="float32", capability="9.0"), "float16/bfloat16, got float32"),
                     (dict(capability="8.0"), "head dim 192 (max(D=192, Dv=128)"),
                     (dict(), "exceeds 128 on compute capability unknown")]:
    name, why = _resolve("auto", "gpu", **kw)
    assert name == "triton" and reason in why, (kw, why)
  assert _resolve("auto", "gpu", capability="8.0", d=64, dv=64)[0] == "cudnn"
  assert _resolve("auto", "rocm")[0] == "triton"          # no cuDNN off NVIDIA
  # Neither kernel takes it: blockwise, both reasons.
  name, why = _resolve("auto", "gpu", d=320, has_segments=True)
  assert name == "blockwise" and "packed segment ids" in why and "triton head dim 512" in why


def test_explicit_impls():
  for impl in ("dense", "blockwise"):
    for backend in ("cpu", "gpu", "tpu"):
      assert _resolve(impl, backend) == (impl, f"compute.mla_impl={impl!r}")
  assert _resolve("triton", "gpu", has_segments=True) == ("triton", "compute.mla_impl='triton'")
  assert _resolve("splash", "tpu", dtype="float32")[0] == "splash"
  assert _resolve("cudnn", "gpu", capability="9.0")[0] == "cudnn"
  # A kernel that cannot take the input falls back with the reason.
  name, why = _resolve("cudnn", "gpu", has_segments=True, capability="9.0")
  assert name == "blockwise" and why.startswith("compute.mla_impl='cudnn' falls back")
  # A kernel on the wrong backend: a clear error (interpret mode lifts it for Pallas only).
  for impl, backend in [("triton", "cpu"), ("splash", "gpu"), ("cudnn", "tpu"),
                        ("cudnn", "rocm")]:
    with pytest.raises(ValueError, match=f"compute.mla_impl='{impl}' runs on backend .*"
                                         f"'{backend}'"):
      _resolve(impl, backend)
  assert _resolve("triton", "cpu", interpret=True)[1].endswith("(interpret mode)")
  with pytest.raises(ValueError, match="compute.mla_impl='cudnn' runs on"):
    _resolve("cudnn", "cpu", interpret=True)
  with pytest.raises(ValueError, match=r"compute.mla_impl='flash': expected one of"):
    _resolve("flash", "gpu")


def test_memory_core():
  assert ab.memory_core("auto", 512, 128) == "dense"
  assert ab.memory_core("auto", 513, 128) == "blockwise"
  assert [ab.memory_core(i, 64, 128) for i in ab.KERNELS] == ["blockwise"] * 3
  assert ab.memory_core("dense", 10 ** 6, 128) == "dense"
  assert dry_run._core_label("splash", "blockwise") == "splash, counted as blockwise"
  assert dry_run._core_label("auto", "dense") == "dense"


def test_report_names_the_core_and_warns_on_fallback(monkeypatch):
  cfg = ModelConfig(num_layers=4)
  mla = lambda compute, backend: describe_impls(cfg, compute, backend=backend)[1]
  line = mla(ComputeConfig(), "cpu")
  assert line.startswith("layer 3 (mla): dense [T, T] scores in XLA up to T = 512, blockwise")
  line = mla(ComputeConfig(dtype="bfloat16"), "gpu")   # training batches carry segment ids
  assert "Pallas Triton" in line and "packed segment ids" in line
  assert "Pallas splash" in mla(ComputeConfig(), "tpu")
  logged = []
  monkeypatch.setattr("hybridmoe_jax.model.impls.logging.warning",
                      lambda fmt, line: logged.append(("warning", line)))
  monkeypatch.setattr("hybridmoe_jax.model.impls.logging.info",
                      lambda fmt, line: logged.append(("info", line)))
  for compute, backend in [(ComputeConfig(dtype="bfloat16"), "gpu"),
                           (ComputeConfig(mla_impl="dense"), "gpu"), (ComputeConfig(), "cpu")]:
    log_impls(cfg, compute, backend=backend)
    assert [lvl for lvl, l in logged if "(mla)" in l] == ["info"], (compute, backend)
    logged.clear()
  wide = ModelConfig(num_layers=4, mla=MLAConfig(qk_nope_head_dim=320))
  log_impls(wide, ComputeConfig(), backend="gpu")
  assert [lvl for lvl, l in logged if "(mla)" in l] == ["warning"]
  assert "falls back to blockwise" in next(l for _, l in logged if "(mla)" in l)


# ------------------------------------------------------------------------------ MLA layer
@pytest.mark.parametrize("impl", ["triton", "splash"])
def test_mla_layer_kernel_equals_dense(impl, monkeypatch):
  """The MLA training forward and its parameter gradients: the interpreted kernel == dense."""
  ran = []
  attend = ab.attend
  monkeypatch.setattr(ab, "attend", lambda name, *a, **kw: ran.append(name) or attend(
      name, *a, **kw))
  cfg = MLAConfig(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 45, 32)), jnp.float32)
  seg = packed_segments(7, 2, 45)
  outs = {}
  for name in ("dense", impl):
    layer = MLALayer(32, cfg, norm_eps=1e-6, rngs=nnx.Rngs(0), interpret=True,
                     compute=ComputeConfig(mla_impl=name, mla_block=16))

    def loss(layer):
      return jnp.sum(jnp.sin(layer(x, segment_ids=seg)[0]))

    @nnx.jit   # one program, not op by op (see _value_and_grads)
    def out_and_grads(layer):
      return layer(x, segment_ids=seg)[0], nnx.grad(loss)(layer)

    outs[name] = out_and_grads(layer)
  assert set(ran) == {"dense", impl}     # the kernel itself ran, not a fallback
  assert rel_err(outs[impl][0], outs["dense"][0]) < 1e-5
  g_kernel, g_dense = (jax.tree.leaves(nnx.to_pure_dict(outs[i][1])) for i in (impl, "dense"))
  for a, r in zip(g_kernel, g_dense):
    assert rel_err(a, r) < 1e-4
  with pytest.raises(ValueError, match=f"compute.mla_impl='{impl}' runs on backend"):
    MLALayer(32, cfg, norm_eps=1e-6, rngs=nnx.Rngs(0),
             compute=ComputeConfig(mla_impl=impl))(x, segment_ids=seg)
