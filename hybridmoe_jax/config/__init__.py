"""Typed, validated configuration: the one field checker, the model and the compute config.

Config files in `configs/` build an `ml_collections.ConfigDict`; at the CLI boundary
`from_dict` turns each section into a frozen dataclass (the whole run: `config/run.py`, the
model alone: `model_config_from_dict`), checking names and types; `check_tree` checks
ranges, each field's declared once beside its default (`ranged`), and a dataclass's `check`
relates its fields. Every check raises `ConfigError` naming the dotted field, the value and
the allowed range, before anything is allocated. Field names follow DESIGN.md and, where
they exist, the upstream Hugging Face config keys.

Runtime knobs (precision, remat, kernel choice, EP capacity) live in `ComputeConfig`;
`migrate_legacy` moves them out of older saved configs (`MOVED` names their new place).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import types
import typing
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from hybridmoe_jax.config.legacy import MOVED, migrate_legacy, plain  # noqa: F401 (re-exported)

LAYER_KINDS = ("kda", "mla")
GLU_KINDS = ("situ", "swiglu")
GATE_KINDS = ("bounded", "unbounded")
BALANCING = ("qb", "sign", "none")
KDA_IMPLS = ("auto", "recurrent", "chunked", "pallas")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
  """A config field holds a value outside its allowed range; `field`: its dotted name where
  one field is at fault (`require`), else None."""

  def __init__(self, message: str, field: str | None = None):
    super().__init__(message)
    self.field = field


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
  """Raise `ConfigError` naming `field`, its `value` and the `allowed` range unless `ok`."""
  if not ok:
    raise ConfigError(f"config field `{field}` = {value!r} is invalid: allowed {allowed}", field)


def is_int(v) -> bool:
  """A python / numpy integer, not a bool."""
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_number(v) -> bool:
  """A python / numpy integer or float, not a bool (nor a traced array)."""
  return is_int(v) or isinstance(v, (float, np.floating))


def _join(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix else name


class Allowed(typing.NamedTuple):
  """Allowed values that are neither an interval nor a tuple of choices: a test, its text."""

  ok: Callable[[Any], bool]
  text: str


def ranged(default, allowed, note: str = "", nonempty: bool = False):
  """A dataclass field whose allowed values are declared once, beside its default.

  Args:
    default: the default (a dict or list is copied per instance).
    allowed: an interval such as '>= 1', '> 0', '[0, 1)', '(0, 10]' (integers for an int
      field, finite numbers for a float one), a tuple of choices, or an `Allowed`. The
      elements of a tuple or dict field are checked one by one (an `Allowed` sees the
      whole value).
    note: what special values mean, shown in parentheses after the range ("0: off").
    nonempty: a tuple / dict field must hold at least one element.
  """
  meta = {"allowed": allowed, "note": note, "nonempty": nonempty}
  if isinstance(default, (dict, list)):
    return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


_INTERVAL = re.compile(r"(>=?) (\S+)|([\[(])(\S+), (\S+)([\])])")


@functools.cache
def _interval(spec: str, integer: bool) -> Allowed:
  """'>= 1', '(0, 10]', ... -> the test and text of that interval (of integers or numbers)."""
  m = _INTERVAL.fullmatch(spec)
  if m[1]:
    lo, hi, lo_open, hi_open = float(m[2]), math.inf, m[1] == ">", True
  else:
    lo, hi, lo_open, hi_open = float(m[4]), float(m[5]), m[3] == "(", m[6] == ")"
  kind = is_int if integer else is_number

  def ok(v) -> bool:
    return kind(v) and (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
  name = "an integer" if integer else "a number"
  return Allowed(ok, f"{name} {spec}" if m[1] else f"{name} in {spec}")


def _check_value(tp, allowed, value, field: str, note: str) -> None:
  if isinstance(allowed, str):
    allowed = _interval(allowed, tp is int)
  elif not isinstance(allowed, Allowed):
    allowed = Allowed(allowed.__contains__, f"one of {allowed}")
  require(allowed.ok(value), field, value, allowed.text + note)


def _check_field(tp, meta: Mapping[str, Any], value, field: str) -> None:
  """`value` of the field typed `tp` against its declared range (`ranged`'s metadata)."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    if value is None:
      return
    (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
  origin, args, allowed = typing.get_origin(tp), typing.get_args(tp), meta["allowed"]
  note = f" ({meta['note']})" if meta["note"] else ""
  if origin not in (tuple, dict) or isinstance(allowed, Allowed):
    return _check_value(tp, allowed, value, field, note)
  require(len(value) > 0 or not meta["nonempty"], field, value, "at least one element")
  items = value.items() if origin is dict else enumerate(value)
  for k, v in items:
    _check_value(args[-1] if origin is dict else args[0], allowed, v,
                 _join(field, k) if origin is dict else f"{field}[{k}]", note)


@functools.cache
def _hints(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def check_tree(obj, prefix: str) -> None:
  """THE range check of a config dataclass `obj` at the dotted place `prefix`.

  Every field with a declared range (`ranged`) is checked, then the dataclasses it holds
  in a field, a tuple or a dict that have no fixed place of their own (`PATH` None: curriculum
  stages, RL environments), then `obj.check(prefix)`: the checks across fields.
  """
  hints = _hints(type(obj))
  for f in dataclasses.fields(obj):
    value, field = getattr(obj, f.name), _join(prefix, f.name)
    if "allowed" in f.metadata:
      _check_field(hints[f.name], f.metadata, value, field)
    subs = (((_join(field, k), v) for k, v in value.items()) if isinstance(value, dict) else
            ((f"{field}[{i}]", v) for i, v in enumerate(value)) if isinstance(value, tuple)
            else [(field, value)])
    for name, sub in subs:
      if isinstance(sub, Checked) and sub.PATH is None:
        check_tree(sub, name)
  obj.check(prefix)


class Checked:
  """Base of the config dataclasses. A class with a fixed place in the tree (`PATH`, e.g.
  "model.kda") checks itself there when built; one held in a dict or tuple (PATH None) is
  checked by its parent's `check_tree` under its key."""

  PATH: ClassVar[str | None] = None

  def __post_init__(self):
    if self.PATH is not None:
      check_tree(self, self.PATH)

  def check(self, p: str) -> None:
    """Checks that relate several fields (ConfigError naming `p.field`); none by default."""


MOE_IMPLS = ("ragged", "dense")
MLA_IMPLS = ("auto", "dense", "blockwise", "cudnn", "triton", "splash")
REMAT_POLICIES = ("none", "full", "dots")


@dataclasses.dataclass(frozen=True)
class ComputeConfig(Checked):
  """How a model computes, not what it is: none of these fields changes the parameters, so
  a run may resume with other values (the `compute` config section); scan_layers changes
  only their layout (convert with `model.stack.stack_state` / `unstack_state`).

  The architecture (`ModelConfig`) is what a checkpoint must match; this is what a user
  tunes per machine: precision, rematerialisation and which kernel implements each op.
  """

  PATH = "compute"
  dtype: str = ranged("float32", DTYPES)  # activation / matmul dtype; parameters stay float32
  remat: str = ranged("none", REMAT_POLICIES)  # decoder-layer rematerialisation
  kda_impl: str = ranged("auto", KDA_IMPLS)  # KDA op: "auto" (pallas -> chunked), ...
  # chunk of the chunked / Pallas KDA
  kda_chunk_size: int = ranged(64, Allowed(lambda v: is_int(v) and v >= 16 and v & (v - 1) == 0,
                                           "a power of two >= 16"))
  # local expert FFN: "ragged" (sorted ragged_dot) or "dense"
  moe_impl: str = ranged("ragged", MOE_IMPLS)
  # Expert-parallel receive buffer: 0 -> dropless (worst-case buffers); c > 0 -> each
  # expert shard receives at most ceil(c * m k) rows per step, the excess dropped, counted.
  moe_capacity_factor: float = ranged(
      0.0, ">= 0", "0: dropless; else receive-buffer rows / local assignments")
  # Experts to compute dtype "sharded" (before gathers: dtype gathers/grad reductions) or after.
  moe_weight_cast: str = ranged("sharded", ("sharded", "gathered"))
  # MLA training attention: "dense" holds [B, H, T, T] scores; "blockwise" holds one
  # [B, H, mla_block, mla_block] block at a time (forward and backward); the kernels "cudnn"
  # (GPU, unpacked bf16 input), "triton" (GPU) and "splash" (TPU) tile by mla_block. "auto":
  # splash on TPU, cudnn else triton on GPU (blockwise when neither takes the input); on CPU
  # dense up to T = 4 * mla_block (the loop costs more than the small matrix), else blockwise.
  mla_impl: str = ranged("auto", MLA_IMPLS)
  mla_block: int = ranged(128, ">= 8")
  # Run the layers that repeat (one period of model.layer_kinds after the dense ones) as one
  # jax.lax.scan over stacked parameters (`model.stack`): compile time stops growing with
  # depth. Unlike the fields above it changes the state's LAYOUT ("stack/<j>" leaves
  # [R, ...] instead of "layers/<i>"): convert with model.stack.stack_state/unstack_state.
  scan_layers: bool = ranged(False, Allowed(lambda v: isinstance(v, (bool, np.bool_)),
                                            "True or False"))
  # Repeats per iteration of that scan (tools/aot.py compiles 1 and 2 to cost the loop).
  scan_unroll: int = ranged(1, ">= 1")


@dataclasses.dataclass(frozen=True)
class KDAConfig(Checked):
  """Kimi Delta Attention layer (DESIGN s1.4)."""

  PATH = "model.kda"
  num_heads: int = ranged(4, ">= 1")        # H: q/k heads
  num_v_heads: int = ranged(4, ">= 1")      # HV: value heads (grouped: a multiple of H)
  head_dim: int = ranged(16, ">= 1")        # K
  v_head_dim: int = ranged(16, ">= 1")      # V
  conv_size: int = ranged(4, ">= 1")        # short causal depthwise conv kernel
  # "bounded": lb*sigmoid(.); "unbounded": -exp(A)*softplus(.)
  gate: str = ranged("bounded", GATE_KINDS)
  lower_bound: float = ranged(-5.0, "[-5, 0)")  # lb of the bounded gate
  gate_rank: int = ranged(0, ">= 0", "0: head_dim")  # rank of the decay projection
  # -1: full-rank output gate; r > 0: low rank r; 0 -> head_dim
  output_gate_rank: int = ranged(-1, ">= -1", "-1: full rank, 0: head_dim, else the rank")

  def check(self, p: str) -> None:
    require(self.num_v_heads % self.num_heads == 0, f"{p}.num_v_heads", self.num_v_heads,
            f"a multiple of num_heads={self.num_heads}")

  @property
  def decay_rank(self) -> int:
    return self.gate_rank or self.head_dim

  @property
  def out_gate_rank(self) -> int | None:
    """None for a full-rank output gate, else the low rank."""
    if self.output_gate_rank < 0:
      return None
    return self.output_gate_rank or self.head_dim


@dataclasses.dataclass(frozen=True)
class MLAConfig(Checked):
  """Gated multi-head latent attention without positional encoding (DESIGN s2)."""

  PATH = "model.mla"
  num_heads: int = ranged(4, ">= 1")
  q_lora_rank: int = ranged(0, ">= 0", "0: direct query projection")
  kv_lora_rank: int = ranged(32, ">= 1")   # d_c, the cached latent
  qk_nope_head_dim: int = ranged(16, ">= 1")
  # shared key slot, never rotated (NoPE) unless rope_theta > 0
  qk_rope_head_dim: int = ranged(8, ">= 0")
  v_head_dim: int = ranged(16, ">= 1")
  output_gate: bool = True      # sigmoid(W_gate x) elementwise on each head's output
  # > 0: rotate the rope slot (RoPE, this base); 0: NoPE (ablation)
  rope_theta: float = ranged(0.0, ">= 0", "0: NoPE")
  # scores times max(1, log n / log logn_base), n the keys a query sees (layers/mla.py)
  logn_base: int = ranged(0, Allowed(lambda v: is_int(v) and v >= 0 and v != 1,
                                     "0 (off) or an integer >= 2"))

  def check(self, p: str) -> None:
    if self.rope_theta:
      require(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
              f"{p}.qk_rope_head_dim", self.qk_rope_head_dim,
              "an even number > 0 when model.mla.rope_theta > 0 (RoPE rotates pairs)")

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MoEConfig(Checked):
  """Sparse MoE feed-forward with Quantile Balancing (DESIGN s4). Ranges against d_model
  and num_layers are `ModelConfig.check`'s."""

  PATH = "model.moe"
  num_experts: int = ranged(8, ">= 2")          # E routed experts
  experts_per_token: int = ranged(2, ">= 1")    # k
  expert_intermediate: int = ranged(64, ">= 1")  # routed expert FFN width
  # fused into one MLP of width n * shared_intermediate
  num_shared_experts: int = ranged(1, ">= 0")
  shared_intermediate: int = ranged(64, ">= 1")
  # l: routed experts run at width l < d; 0 -> no latent MoE
  latent_dim: int = ranged(0, ">= 0", "0: off; else below d_model")
  glu: str = ranged("situ", GLU_KINDS)          # "situ" (bounded GLU) or "swiglu"
  routed_scale: float = ranged(1.0, "> 0")
  renormalize: bool = True          # combine weights s / sum(s) (False: s itself) x routed_scale
  # leading layers with a dense FFN instead of MoE (at most num_layers)
  first_dense_layers: int = ranged(1, ">= 0")
  dense_intermediate: int = ranged(128, ">= 1")
  balancing: str = ranged("qb", BALANCING)     # "qb", "sign" (DeepSeek rule) or "none"
  qb_num_bins: int = ranged(1000, ">= 1")       # histogram bins of the scalable QB update
  sign_gamma: float = ranged(1e-3, "> 0")       # step of the DeepSeek sign rule

  def check(self, p: str) -> None:
    # top_k(k + 1) needs one expert beyond the k routed ones for the QB cutoff.
    require(self.experts_per_token < self.num_experts, f"{p}.experts_per_token",
            self.experts_per_token, f"[1, num_experts={self.num_experts})")


@dataclasses.dataclass(frozen=True)
class AttnResConfig(Checked):
  """Block attention residuals across depth (DESIGN s3)."""

  PATH = "model.attnres"
  enabled: bool = True
  block_size: int = ranged(2, ">= 1")   # decoder layers per block


def _buckets_ok(b) -> bool:
  return len(b) > 0 and all(is_int(x) and x > 0 for x in b) and list(b) == sorted(set(b))


@dataclasses.dataclass(frozen=True)
class VisionConfig(Checked):
  """Native vision tower (DESIGN s5): patchify -> embed + 2-D positions -> bidirectional
  encoder -> 2x2 merge -> MLP projector to d_model. Off (enabled=False) for text models."""

  PATH = "model.vision"
  enabled: bool = False
  patch_size: int = ranged(14, ">= 1")    # p: square patches of p x p pixels
  num_channels: int = ranged(3, (1, 3))   # C: 3 (RGB) or 1 (grey)
  width: int = ranged(1024, ">= 1")       # D: encoder width
  num_layers: int = ranged(27, ">= 0")    # bidirectional encoder blocks inside each image
  num_heads: int = ranged(16, ">= 1")     # encoder attention heads (divides width)
  mlp_dim: int = ranged(4096, ">= 1")     # encoder MLP hidden width
  native_grid: int = ranged(64, ">= 1")   # learned position table: native_grid^2 patches
  projector_dim: int = ranged(0, ">= 0", "0: d_model")  # projector hidden width
  # padded square sides (pixels, ascending; multiples of 2 * patch_size)
  image_buckets: tuple[int, ...] = ranged(
      (224, 448, 896), Allowed(_buckets_ok, "a non-empty ascending tuple of sides > 0"))
  max_images_per_row: int = ranged(4, ">= 1")  # image slots per packed sequence

  def check(self, p: str) -> None:
    require(self.width % self.num_heads == 0, f"{p}.num_heads", self.num_heads,
            f"a divisor of width={self.width}")
    require(all(x % (2 * self.patch_size) == 0 for x in self.image_buckets),
            f"{p}.image_buckets", self.image_buckets,
            f"sides that are multiples of 2 * patch_size = {2 * self.patch_size}")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Checked):
  """The whole decoder: layer pattern, widths, and one config per component."""

  PATH = "model"
  vocab_size: int = ranged(259, ">= 1")
  d_model: int = ranged(64, ">= 1")
  num_layers: int = ranged(4, ">= 1")
  # per layer "kda"/"mla"; () -> every 4th and the last
  layer_kinds: tuple[str, ...] = ranged((), LAYER_KINDS)
  norm_eps: float = ranged(1e-5, "(0, 1)")
  kda: KDAConfig = KDAConfig()
  mla: MLAConfig = MLAConfig()
  moe: MoEConfig = MoEConfig()
  attnres: AttnResConfig = AttnResConfig()
  vision: VisionConfig = VisionConfig()

  def __post_init__(self):
    kinds = tuple(self.layer_kinds)
    if not kinds and is_int(self.num_layers) and self.num_layers > 0:
      kinds = default_layer_kinds(self.num_layers)
    object.__setattr__(self, "layer_kinds", kinds)
    super().__post_init__()

  def check(self, p: str) -> None:
    require(len(self.layer_kinds) == self.num_layers, f"{p}.layer_kinds", self.layer_kinds,
            f"a list of num_layers={self.num_layers} entries")
    m = self.moe
    require(m.latent_dim < self.d_model, f"{p}.moe.latent_dim", m.latent_dim,
            f"0 (off) or [1, d_model={self.d_model})")
    require(m.first_dense_layers <= self.num_layers, f"{p}.moe.first_dense_layers",
            m.first_dense_layers, f"[0, num_layers={self.num_layers}]")

  def is_moe_layer(self, i: int) -> bool:
    return i >= self.moe.first_dense_layers

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

  def layer_variants(self) -> dict[tuple[str, bool], list[int]]:
    """(mixer kind, MoE or dense FFN) -> the indices of the layers of that variant, in the
    order variants first occur: what abstract counts trace once and multiply."""
    out: dict[tuple[str, bool], list[int]] = {}
    for i, kind in enumerate(self.layer_kinds):
      out.setdefault((kind, self.is_moe_layer(i)), []).append(i)
    return out


def default_layer_kinds(num_layers: int) -> tuple[str, ...]:
  """MLA at 1-based layers 4, 8, ... and the last layer; KDA elsewhere (DESIGN s3)."""
  return tuple("mla" if (i + 1) % 4 == 0 or i == num_layers - 1 else "kda"
               for i in range(num_layers))


def _coerce(tp, value, field: str):
  """`value` checked against the annotation `tp` (and converted: list -> tuple, ...)."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    (tp,) = [a for a in args if a is not type(None)]
    return _coerce(tp, value, field)
  if dataclasses.is_dataclass(tp):
    return from_dict(tp, {} if value is None else value, field)
  if origin is tuple:
    require(isinstance(value, (tuple, list)), field, value, "a tuple")
    elem = args[0]
    return tuple(_coerce(elem, v, f"{field}[{i}]") for i, v in enumerate(value))
  if origin is dict:
    value = plain(value)
    require(isinstance(value, Mapping) and all(isinstance(k, str) for k in value), field,
            value, "a dict with string keys")
    return {k: _coerce(args[1], v, _join(field, k)) for k, v in value.items()}
  if tp is bool:
    require(isinstance(value, (bool, np.bool_)), field, value, "True or False")
    return bool(value)
  if tp is int:
    require(is_int(value), field, value, "an integer")
    return int(value)
  if tp is float:
    require(is_number(value), field, value, "a number")
    return float(value)
  if tp is str:
    require(isinstance(value, str), field, value, "a string")
    return value
  return value


def from_dict(cls, values: Mapping[str, Any] | None, prefix: str = ""):
  """THE config checker: a frozen dataclass `cls` from a (ConfigDict or) dict.

  Fields missing from `values` take their defaults; unknown fields, a field that moved
  (`MOVED`) and values of the wrong type raise `ConfigError` naming `prefix.field`; nested
  dataclasses, tuples and dicts are built recursively; building a `Checked` class runs
  `check_tree` (the ranges).
  """
  values = plain({} if values is None else values)
  require(isinstance(values, Mapping), prefix or "config", values,
          f"a dict of {cls.__name__} fields")
  hints = _hints(cls)
  names = [f.name for f in dataclasses.fields(cls) if f.init]
  unknown = sorted(set(values) - set(names))
  for name in unknown:
    if _join(prefix, name) in MOVED:
      raise ConfigError(f"config field `{_join(prefix, name)}` moved to "
                        f"`{MOVED[_join(prefix, name)]}`")
  if unknown:
    raise ConfigError(f"unknown config field(s) {', '.join(_join(prefix, u) for u in unknown)};"
                      f" allowed: {sorted(names)}")
  return cls(**{n: _coerce(hints[n], v, _join(prefix, n)) for n, v in values.items()})


def model_config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
  """Build a validated `ModelConfig` from a (ConfigDict or dict) `config.model`."""
  return from_dict(ModelConfig, d, "model")
