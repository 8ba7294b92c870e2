"""Every tensor of a Kimi-Linear checkpoint <-> our parameter leaves (numpy only).

Names on our side are those of a params export (`train/checkpoint.py`): "params/<leaf path>"
(e.g. "params/layers/0/mixer/q_proj/kernel") and "routing_biases/layers/<i>/ffn/bias".
HF names are the released checkpoint's ("model.layers.0.self_attn.q_proj.weight").

Layouts: HF linears are torch [out, in], ours [in, out] (transposed). HF stores each routed
expert as its own w1 (gate) / w3 (up) [I, d] and w2 (down) [d, I]; ours are stacked
w_gate / w_up [E, d, I], w_down [E, I, d]. HF's depthwise conv weight [C, 1, W] is a
cross-correlation over the last W inputs (tap i reads x[t - (W-1) + i]); ours [W, C] has
tap j read x[t - j], so ours[j] = hf[:, 0, W-1-j]. A_log is [1, 1, H, 1] there, [H] here.
MLA: kv_a_proj_with_mqa [d_c + Dr, d] = our kv_a [d, d_c] and k_rope [d, Dr] stacked;
kv_b_proj [H (Dn + Dv), d_c] holds per head Dn rows of W_uk then Dv rows of W_uv, ours are
k_up [d_c, H Dn] and v_up [d_c, H Dv]. The router's e_score_correction_bias is our routing
bias state (the bias that chooses experts, never weighs them).

A `Rule` ties a few names of one side to a few of the other; `produce` streams one output
tensor as chunks of its C-order bytes from a `Source` (reading one input at a time, the
stacked experts expert by expert), so a conversion holds at most about one input tensor.
Values are moved, never changed: dtypes are kept, so HF -> ours -> HF is bit-exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Protocol

import numpy as np

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.io.safetensors import DTYPES, Spec, dtype_code

P, B = "params/", "routing_biases/"
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
_BLOCK = 16 * 2**20     # bytes per streamed chunk of a transposed / copied tensor


class Source(Protocol):
  """Where input tensors come from: a checkpoint reader or an in-memory dict."""

  def info(self, name: str): ...                                   # .dtype code, .shape

  def read(self, name: str) -> np.ndarray: ...

  def read_rows(self, name: str, start: int, stop: int) -> np.ndarray: ...


class TensorMismatch(ValueError):
  """Source tensors that are unknown, missing, or of the wrong shape / dtype (all named)."""


@dataclasses.dataclass(frozen=True)
class Rule:
  """`ours` <-> `hf` tensors, related by `kind`; `shapes`: every name's shape."""

  kind: str
  ours: tuple[str, ...]
  hf: tuple[str, ...]
  shapes: dict[str, tuple[int, ...]]
  dims: tuple[int, ...] = ()


def _linear(ours: str, hf: str, d_in: int, d_out: int) -> Rule:
  return Rule("T", (ours,), (hf,), {ours: (d_in, d_out), hf: (d_out, d_in)})


def _copy(ours: str, hf: str, shape: tuple[int, ...]) -> Rule:
  return Rule("copy", (ours,), (hf,), {ours: shape, hf: shape})


def weight_rules(cfg: ModelConfig) -> list[Rule]:
  """The rules of every tensor of `cfg` (a Kimi-expressible config), in file order."""
  d, v = cfg.d_model, cfg.vocab_size
  rules = [_copy(P + "embed/embedding", "model.embed_tokens.weight", (v, d))]
  for i, kind in enumerate(cfg.layer_kinds):
    o, h = f"{P}layers/{i}/", f"model.layers.{i}."
    rules.append(_copy(o + "mixer_norm/scale", h + "input_layernorm.weight", (d,)))
    rules += _kda_rules(cfg, o + "mixer/", h + "self_attn.") if kind == "kda" else (
        _mla_rules(cfg, o + "mixer/", h + "self_attn."))
    rules.append(_copy(o + "ffn_norm/scale", h + "post_attention_layernorm.weight", (d,)))
    if cfg.is_moe_layer(i):
      rules += _moe_rules(cfg, i, o + "ffn/", h + "block_sparse_moe.")
    else:
      w = cfg.moe.dense_intermediate
      rules += [_linear(o + "ffn/gate", h + "mlp.gate_proj.weight", d, w),
                _linear(o + "ffn/up", h + "mlp.up_proj.weight", d, w),
                _linear(o + "ffn/down", h + "mlp.down_proj.weight", w, d)]
  rules += [_copy(P + "final_norm/scale", "model.norm.weight", (d,)),
            _linear(P + "lm_head/kernel", "lm_head.weight", d, v)]
  return rules


def _kda_rules(cfg: ModelConfig, o: str, h: str) -> list[Rule]:
  c, d = cfg.kda, cfg.d_model
  hk, k, w = c.num_heads * c.head_dim, c.head_dim, c.conv_size
  rules = [_linear(o + f"{x}_proj/kernel", h + f"{x}_proj.weight", d, hk) for x in "qkv"]
  rules += [Rule("conv", (o + f"{x}_conv/weight",), (h + f"{x}_conv1d.weight",),
                 {o + f"{x}_conv/weight": (w, hk), h + f"{x}_conv1d.weight": (hk, 1, w)})
            for x in "qkv"]
  rules += [_linear(o + "f_a/kernel", h + "f_a_proj.weight", d, k),
            _linear(o + "f_b/kernel", h + "f_b_proj.weight", k, hk),
            _linear(o + "b_proj/kernel", h + "b_proj.weight", d, c.num_heads),
            _linear(o + "g_proj/layers/0/kernel", h + "g_a_proj.weight", d, k),
            _linear(o + "g_proj/layers/1/kernel", h + "g_b_proj.weight", k, hk),
            Rule("copy", (o + "a_log",), (h + "A_log",),
                 {o + "a_log": (c.num_heads,), h + "A_log": (1, 1, c.num_heads, 1)}),
            _copy(o + "dt_bias", h + "dt_bias", (hk,)),
            _copy(o + "o_norm_scale", h + "o_norm.weight", (k,)),
            _linear(o + "o_proj/kernel", h + "o_proj.weight", hk, d)]
  return rules


def _mla_rules(cfg: ModelConfig, o: str, h: str) -> list[Rule]:
  c, d = cfg.mla, cfg.d_model
  r, dr, dn, dv, n = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, (
      c.num_heads)
  kv_a = (o + "kv_a/kernel",) + ((o + "k_rope/kernel",) if dr else ())
  shapes = {o + "kv_a/kernel": (d, r), o + "k_rope/kernel": (d, dr),
            h + "kv_a_proj_with_mqa.weight": (r + dr, d)}
  return [_linear(o + "q_proj/kernel", h + "q_proj.weight", d, n * c.qk_head_dim),
          Rule("stack_T", kv_a, (h + "kv_a_proj_with_mqa.weight",),
               {k: shapes[k] for k in kv_a + (h + "kv_a_proj_with_mqa.weight",)}),
          _copy(o + "kv_norm/scale", h + "kv_a_layernorm.weight", (r,)),
          Rule("kv_b", (o + "k_up/kernel", o + "v_up/kernel"), (h + "kv_b_proj.weight",),
               {o + "k_up/kernel": (r, n * dn), o + "v_up/kernel": (r, n * dv),
                h + "kv_b_proj.weight": (n * (dn + dv), r)}, dims=(n, dn, dv)),
          _linear(o + "o_proj/kernel", h + "o_proj.weight", n * dv, d)]


def _moe_rules(cfg: ModelConfig, i: int, o: str, h: str) -> list[Rule]:
  c, d = cfg.moe, cfg.d_model
  e, w = c.num_experts, c.expert_intermediate
  rules = [_linear(o + "router", h + "gate.weight", d, e),
           _copy(f"{B}layers/{i}/ffn/bias", h + "gate.e_score_correction_bias", (e,))]
  for ours, hf, shape in (("w_gate", "w1", (d, w)), ("w_up", "w3", (d, w)),
                          ("w_down", "w2", (w, d))):
    names = tuple(h + f"experts.{j}.{hf}.weight" for j in range(e))
    rules.append(Rule("experts", (o + ours,), names,
                      {o + ours: (e,) + shape, **{n: shape[::-1] for n in names}}))
  width = c.num_shared_experts * c.shared_intermediate
  if width:
    rules += [_linear(o + "shared/gate", h + "shared_experts.gate_proj.weight", d, width),
              _linear(o + "shared/up", h + "shared_experts.up_proj.weight", d, width),
              _linear(o + "shared/down", h + "shared_experts.down_proj.weight", width, d)]
  return rules


# ------------------------------------------------------------------------------ checking
def check_source(rules: list[Rule], src: Source, names, *, to: str, where: str) -> list[Spec]:
  """Compare a source's tensors with what `rules` read; -> the output specs, in order.

  Args:
    rules: from `weight_rules`.
    src: the source; names: every tensor name it holds.
    to: "ours" (the source is HF) or "hf" (the source is ours).
    where: the source path, for messages.
  Raises:
    TensorMismatch: one message naming every unknown, missing, mis-shaped or non-float
      tensor of the source (up to 8 of each kind, with counts).
  """
  side_in = (lambda r: r.hf) if to == "ours" else (lambda r: r.ours)
  side_out = (lambda r: r.ours) if to == "ours" else (lambda r: r.hf)
  want = {n: r.shapes[n] for r in rules for n in side_in(r)}
  have = set(names)
  problems = []

  def report(what, items):
    if items:
      more = f" (+{len(items) - 8} more)" if len(items) > 8 else ""
      problems.append(f"{len(items)} {what}: {', '.join(items[:8])}{more}")

  report("unknown tensor(s) (not part of this config's model)", sorted(have - set(want)))
  report("missing tensor(s)", sorted(set(want) - have))
  present = sorted(have & set(want))
  report("tensor(s) of the wrong shape", [
      f"{n} {list(src.info(n).shape)} (expected {list(want[n])})" for n in present
      if tuple(src.info(n).shape) != want[n]])
  report("non-float tensor(s)", [f"{n} ({src.info(n).dtype})" for n in present
                                 if src.info(n).dtype not in FLOAT_CODES])
  if problems:
    raise TensorMismatch(f"{where} does not match the config's {'HF Kimi-Linear' if to == 'ours' else 'our'} "
                         f"layout: " + "; ".join(problems))
  specs = []
  for r in rules:
    codes = [src.info(n).dtype for n in side_in(r)]
    code = dtype_code(np.result_type(*[DTYPES[c] for c in codes]))
    specs += [Spec(n, code, r.shapes[n]) for n in side_out(r)]
  return specs


# ------------------------------------------------------------------------------ streaming
def _rows(src: Source, name: str) -> Iterator[np.ndarray]:
  info = src.info(name)
  shape = tuple(info.shape)
  if len(shape) < 1:
    yield src.read(name)
    return
  row = math.prod(shape[1:]) * DTYPES[info.dtype].itemsize
  step = max(1, _BLOCK // max(row, 1))
  for a in range(0, shape[0], step):
    yield src.read_rows(name, a, min(shape[0], a + step))


def _transposed(x: np.ndarray) -> Iterator[np.ndarray]:
  """x [a, b] -> the rows of x.T [b, a], in blocks of ~_BLOCK bytes (one copy at a time)."""
  step = max(1, _BLOCK // max(x.shape[0] * x.itemsize, 1))
  for c in range(0, x.shape[1], step):
    yield np.ascontiguousarray(x[:, c:c + step].T)


def produce(rule: Rule, name: str, src: Source, *, to: str) -> Iterator[np.ndarray]:
  """The chunks (C order, concatenated) of output tensor `name` of `rule`, read from `src`."""
  k = rule.kind
  if k == "copy":
    yield from _rows(src, rule.hf[0] if to == "ours" else rule.ours[0])
  elif k == "T":
    yield from _transposed(src.read(rule.hf[0] if to == "ours" else rule.ours[0]))
  elif k == "conv":
    if to == "ours":
      yield np.ascontiguousarray(src.read(rule.hf[0])[:, 0, ::-1].T)
    else:
      yield np.ascontiguousarray(src.read(rule.ours[0]).T[:, None, ::-1])
  elif k == "stack_T":
    if to == "ours":
      x = src.read(rule.hf[0])
      r = rule.shapes[rule.ours[0]][1]
      yield np.ascontiguousarray((x[:r] if name == rule.ours[0] else x[r:]).T)
    else:
      for part in rule.ours:
        yield np.ascontiguousarray(src.read(part).T)
  elif k == "kv_b":
    n, dn, dv = rule.dims
    if to == "ours":
      x = src.read(rule.hf[0])
      r = x.shape[1]
      x = x.reshape(n, dn + dv, r)
      part = x[:, :dn] if name == rule.ours[0] else x[:, dn:]
      yield np.ascontiguousarray(part.transpose(2, 0, 1).reshape(r, -1))
    else:
      k_up, v_up = src.read(rule.ours[0]), src.read(rule.ours[1])
      r = k_up.shape[0]
      k_up, v_up = k_up.reshape(r, n, dn), v_up.reshape(r, n, dv)
      for head in range(n):
        yield np.ascontiguousarray(k_up[:, head].T)
        yield np.ascontiguousarray(v_up[:, head].T)
  elif k == "experts":
    if to == "ours":
      for hf in rule.hf:
        yield np.ascontiguousarray(src.read(hf).T)
    else:
      j = rule.hf.index(name)
      yield np.ascontiguousarray(src.read_rows(rule.ours[0], j, j + 1)[0].T)
  else:
    raise ValueError(f"unknown rule kind {k!r}")


def outputs(rules: list[Rule], *, to: str) -> Iterator[tuple[Rule, str]]:
  """(rule, output name) for every output tensor, in file order."""
  for r in rules:
    for n in (r.ours if to == "ours" else r.hf):
      yield r, n
