"""Typed, validated configuration: the one field checker, the model and the compute config.

Config files in `configs/` build an `ml_collections.ConfigDict`; at the CLI boundary
`from_dict` turns each section into a frozen dataclass (the whole run: `run_config.py`,
the model alone: `model_config_from_dict`). `from_dict` checks names and types (unknown
fields, ints / floats / bools / strings, tuples, dicts, nested dataclasses); each dataclass
checks its ranges in `__post_init__`. Every check raises `ConfigError` naming the field, the
value and the allowed range, before anything is allocated. Field names follow DESIGN.md
and, where they exist, the upstream Hugging Face config keys.

Runtime knobs (precision, remat, kernel choice, EP capacity) are not architecture: they
live in `ComputeConfig`. Configs saved by older runs hold them in the model / train
sections; `migrate_legacy` moves them, and a user config that still sets one gets a
ConfigError naming its new place (`MOVED`).
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Any, Mapping

import numpy as np

LAYER_KINDS = ("kda", "mla")
GLU_KINDS = ("situ", "swiglu")
GATE_KINDS = ("bounded", "unbounded")
BALANCING = ("qb", "sign", "none")
KDA_IMPLS = ("auto", "recurrent", "chunked", "pallas")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
  """A config field holds a value outside its allowed range."""


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
  """Raise `ConfigError` naming `field`, its `value` and the `allowed` range unless `ok`."""
  if not ok:
    raise ConfigError(f"config field `{field}` = {value!r} is invalid: allowed {allowed}")


def _positive(prefix: str, **fields: int) -> None:
  for name, value in fields.items():
    require(isinstance(value, int) and value > 0, f"{prefix}.{name}", value, "an integer >= 1")


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


MOE_IMPLS = ("ragged", "dense")
MLA_IMPLS = ("auto", "dense", "blockwise", "cudnn", "triton", "splash")
REMAT_POLICIES = ("none", "full", "dots")


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
  """How a model computes, not what it is: none of these fields changes the parameters or
  the train state, so a run may resume with other values (the `compute` config section).

  The architecture (`ModelConfig`) is what a checkpoint must match; this is what a user
  tunes per machine: precision, rematerialisation and which kernel implements each op.
  """

  dtype: str = "float32"          # activation / matmul dtype; parameters stay float32
  remat: str = "none"             # decoder-layer rematerialisation: "none", "full", "dots"
  kda_impl: str = "auto"          # KDA op: "auto" (pallas -> chunked), "recurrent", ...
  kda_chunk_size: int = 64        # chunk of the chunked / Pallas KDA (power of two >= 16)
  moe_impl: str = "ragged"        # local expert FFN: "ragged" (sorted ragged_dot) or "dense"
  # Expert-parallel receive buffer: 0 -> dropless (worst-case buffers); c > 0 -> each
  # expert shard receives at most ceil(c * m k) rows per step, the excess dropped, counted.
  moe_capacity_factor: float = 0.0
  # MLA training attention: "dense" holds [B, H, T, T] scores; "blockwise" holds one
  # [B, H, mla_block, mla_block] block at a time (forward and backward); the kernels "cudnn"
  # (GPU, unpacked bf16 input), "triton" (GPU) and "splash" (TPU) tile by mla_block. "auto":
  # splash on TPU, cudnn else triton on GPU (blockwise when neither takes the input); on CPU
  # dense up to T = 4 * mla_block (the loop costs more than the small matrix), else blockwise.
  mla_impl: str = "auto"
  mla_block: int = 128

  def __post_init__(self):
    p = "compute"
    require(self.dtype in DTYPES, f"{p}.dtype", self.dtype, f"one of {DTYPES}")
    require(self.remat in REMAT_POLICIES, f"{p}.remat", self.remat,
            f"one of {REMAT_POLICIES}")
    require(self.kda_impl in KDA_IMPLS, f"{p}.kda_impl", self.kda_impl, f"one of {KDA_IMPLS}")
    require(isinstance(self.kda_chunk_size, int) and _is_pow2(self.kda_chunk_size)
            and self.kda_chunk_size >= 16, f"{p}.kda_chunk_size", self.kda_chunk_size,
            "a power of two >= 16")
    require(self.moe_impl in MOE_IMPLS, f"{p}.moe_impl", self.moe_impl, f"one of {MOE_IMPLS}")
    require(self.mla_impl in MLA_IMPLS, f"{p}.mla_impl", self.mla_impl, f"one of {MLA_IMPLS}")
    require(isinstance(self.mla_block, int) and not isinstance(self.mla_block, bool)
            and self.mla_block >= 8, f"{p}.mla_block", self.mla_block, "an integer >= 8")
    require(isinstance(self.moe_capacity_factor, (int, float))
            and not isinstance(self.moe_capacity_factor, bool)
            and self.moe_capacity_factor >= 0, f"{p}.moe_capacity_factor",
            self.moe_capacity_factor,
            "0 (dropless) or a float > 0 (receive-buffer rows / local assignments)")


@dataclasses.dataclass(frozen=True)
class KDAConfig:
  """Kimi Delta Attention layer (DESIGN s1.4)."""

  num_heads: int = 4            # H: q/k heads
  num_v_heads: int = 4          # HV: value heads (grouped: a multiple of H)
  head_dim: int = 16            # K
  v_head_dim: int = 16          # V
  conv_size: int = 4            # short causal depthwise conv kernel
  gate: str = "bounded"         # "bounded": lb*sigmoid(.); "unbounded": -exp(A)*softplus(.)
  lower_bound: float = -5.0     # lb of the bounded gate, in [-5, 0)
  gate_rank: int = 0            # rank of the decay projection; 0 -> head_dim
  output_gate_rank: int = -1    # -1: full-rank output gate; r > 0: low rank r; 0 -> head_dim

  def validate(self, d_model: int) -> None:
    p = "model.kda"
    _positive(p, num_heads=self.num_heads, num_v_heads=self.num_v_heads,
              head_dim=self.head_dim, v_head_dim=self.v_head_dim, conv_size=self.conv_size)
    require(self.num_v_heads % self.num_heads == 0, f"{p}.num_v_heads", self.num_v_heads,
            f"a multiple of num_heads={self.num_heads}")
    require(self.gate in GATE_KINDS, f"{p}.gate", self.gate, f"one of {GATE_KINDS}")
    require(-5.0 <= self.lower_bound < 0.0, f"{p}.lower_bound", self.lower_bound, "[-5, 0)")
    require(self.gate_rank >= 0, f"{p}.gate_rank", self.gate_rank, ">= 0 (0 -> head_dim)")
    require(self.output_gate_rank >= -1, f"{p}.output_gate_rank", self.output_gate_rank,
            "-1 (full rank), 0 (head_dim) or a positive rank")

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
class MLAConfig:
  """Gated multi-head latent attention without positional encoding (DESIGN s2)."""

  num_heads: int = 4
  q_lora_rank: int = 0          # 0: direct query projection
  kv_lora_rank: int = 32        # d_c, the cached latent
  qk_nope_head_dim: int = 16
  qk_rope_head_dim: int = 8     # shared key slot, never rotated (NoPE) unless rope_theta > 0
  v_head_dim: int = 16
  output_gate: bool = True      # sigmoid(W_gate x) elementwise on each head's output
  rope_theta: float = 0.0       # > 0: rotate the rope slot (RoPE, this base); 0: NoPE (ablation)

  def validate(self, d_model: int) -> None:
    p = "model.mla"
    _positive(p, num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
              qk_nope_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim)
    require(self.q_lora_rank >= 0, f"{p}.q_lora_rank", self.q_lora_rank, ">= 0 (0: none)")
    require(self.qk_rope_head_dim >= 0, f"{p}.qk_rope_head_dim", self.qk_rope_head_dim, ">= 0")
    require(self.rope_theta >= 0, f"{p}.rope_theta", self.rope_theta, ">= 0 (0: NoPE)")
    if self.rope_theta:
      require(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
              f"{p}.qk_rope_head_dim", self.qk_rope_head_dim,
              "an even number > 0 when model.mla.rope_theta > 0 (RoPE rotates pairs)")

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Sparse MoE feed-forward with Quantile Balancing (DESIGN s4)."""

  num_experts: int = 8              # E routed experts
  experts_per_token: int = 2        # k
  expert_intermediate: int = 64     # routed expert FFN width
  num_shared_experts: int = 1       # fused into one MLP of width n * shared_intermediate
  shared_intermediate: int = 64
  latent_dim: int = 0               # l: routed experts run at width l < d; 0 -> no latent MoE
  glu: str = "situ"                 # "situ" (bounded GLU) or "swiglu"
  routed_scale: float = 1.0
  renormalize: bool = True          # combine weights s / sum(s) (False: s itself) x routed_scale
  first_dense_layers: int = 1       # leading layers with a dense FFN instead of MoE
  dense_intermediate: int = 128
  balancing: str = "qb"             # "qb", "sign" (DeepSeek rule) or "none"
  qb_num_bins: int = 1000           # histogram bins of the scalable QB update
  sign_gamma: float = 1e-3          # step of the DeepSeek sign rule

  def validate(self, d_model: int, num_layers: int) -> None:
    p = "model.moe"
    _positive(p, num_experts=self.num_experts, experts_per_token=self.experts_per_token,
              expert_intermediate=self.expert_intermediate,
              dense_intermediate=self.dense_intermediate, qb_num_bins=self.qb_num_bins)
    # top_k(k + 1) needs one expert beyond the k routed ones for the QB cutoff.
    require(self.experts_per_token < self.num_experts, f"{p}.experts_per_token",
            self.experts_per_token, f"[1, num_experts={self.num_experts})")
    require(self.num_shared_experts >= 0, f"{p}.num_shared_experts",
            self.num_shared_experts, ">= 0")
    if self.num_shared_experts:
      _positive(p, shared_intermediate=self.shared_intermediate)
    require(0 <= self.latent_dim < d_model or self.latent_dim == 0, f"{p}.latent_dim",
            self.latent_dim, f"0 (off) or [1, d_model={d_model})")
    require(self.glu in GLU_KINDS, f"{p}.glu", self.glu, f"one of {GLU_KINDS}")
    require(self.routed_scale > 0, f"{p}.routed_scale", self.routed_scale, "> 0")
    require(0 <= self.first_dense_layers <= num_layers, f"{p}.first_dense_layers",
            self.first_dense_layers, f"[0, num_layers={num_layers}]")
    require(self.balancing in BALANCING, f"{p}.balancing", self.balancing,
            f"one of {BALANCING}")
    require(self.sign_gamma > 0, f"{p}.sign_gamma", self.sign_gamma, "> 0")


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
  """Block attention residuals across depth (DESIGN s3)."""

  enabled: bool = True
  block_size: int = 2           # decoder layers per block

  def validate(self) -> None:
    _positive("model.attnres", block_size=self.block_size)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Native vision tower (DESIGN s5): patchify -> embed + 2-D positions -> bidirectional
  encoder -> 2x2 merge -> MLP projector to d_model. Off (enabled=False) for text models."""

  enabled: bool = False
  patch_size: int = 14          # p: square patches of p x p pixels
  num_channels: int = 3         # C: 3 (RGB) or 1 (grey)
  width: int = 1024             # D: encoder width
  num_layers: int = 27          # bidirectional encoder blocks inside each image (0 allowed)
  num_heads: int = 16           # encoder attention heads (divides width)
  mlp_dim: int = 4096           # encoder MLP hidden width
  native_grid: int = 64         # learned position table: native_grid x native_grid patches
  projector_dim: int = 0        # projector hidden width; 0 -> d_model
  image_buckets: tuple[int, ...] = (224, 448, 896)  # padded square sides (pixels, ascending)
  max_images_per_row: int = 4   # image slots per packed sequence

  def validate(self, d_model: int) -> None:
    if not self.enabled:
      return
    p = "model.vision"
    _positive(p, patch_size=self.patch_size, width=self.width, num_heads=self.num_heads,
              mlp_dim=self.mlp_dim, native_grid=self.native_grid,
              max_images_per_row=self.max_images_per_row)
    require(self.num_channels in (1, 3), f"{p}.num_channels", self.num_channels, "1 or 3")
    require(isinstance(self.num_layers, int) and self.num_layers >= 0, f"{p}.num_layers",
            self.num_layers, "an integer >= 0")
    require(self.width % self.num_heads == 0, f"{p}.num_heads", self.num_heads,
            f"a divisor of width={self.width}")
    require(self.projector_dim >= 0, f"{p}.projector_dim", self.projector_dim,
            ">= 0 (0 -> d_model)")
    b = tuple(self.image_buckets)
    require(len(b) > 0 and all(isinstance(x, int) and x > 0 and x % (2 * self.patch_size) == 0
                                for x in b) and list(b) == sorted(set(b)),
            f"{p}.image_buckets", b,
            f"a non-empty ascending tuple of sides that are multiples of 2 * patch_size = "
            f"{2 * self.patch_size}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The whole decoder: layer pattern, widths, and one config per component."""

  vocab_size: int = 259
  d_model: int = 64
  num_layers: int = 4
  layer_kinds: tuple[str, ...] = ()   # per layer "kda"/"mla"; () -> every 4th and the last
  norm_eps: float = 1e-5
  kda: KDAConfig = KDAConfig()
  mla: MLAConfig = MLAConfig()
  moe: MoEConfig = MoEConfig()
  attnres: AttnResConfig = AttnResConfig()
  vision: VisionConfig = VisionConfig()

  def __post_init__(self):
    _positive("model", vocab_size=self.vocab_size, d_model=self.d_model,
              num_layers=self.num_layers)
    if not self.layer_kinds:
      object.__setattr__(self, "layer_kinds", default_layer_kinds(self.num_layers))
    kinds = tuple(self.layer_kinds)
    object.__setattr__(self, "layer_kinds", kinds)
    require(len(kinds) == self.num_layers, "model.layer_kinds", kinds,
            f"a list of num_layers={self.num_layers} entries")
    for i, kind in enumerate(kinds):
      require(kind in LAYER_KINDS, f"model.layer_kinds[{i}]", kind, f"one of {LAYER_KINDS}")
    require(0 < self.norm_eps < 1, "model.norm_eps", self.norm_eps, "(0, 1)")
    self.kda.validate(self.d_model)
    self.mla.validate(self.d_model)
    self.moe.validate(self.d_model, self.num_layers)
    self.attnres.validate()
    self.vision.validate(self.d_model)

  def is_moe_layer(self, i: int) -> bool:
    return i >= self.moe.first_dense_layers

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))


def default_layer_kinds(num_layers: int) -> tuple[str, ...]:
  """MLA at 1-based layers 4, 8, ... and the last layer; KDA elsewhere (DESIGN s3)."""
  return tuple("mla" if (i + 1) % 4 == 0 or i == num_layers - 1 else "kda"
               for i in range(num_layers))


# Fields that moved out of the model / train sections: old name -> new name.
MOVED = {
    "model.dtype": "compute.dtype",
    "model.kda.impl": "compute.kda_impl",
    "model.kda.chunk_size": "compute.kda_chunk_size",
    "model.moe.capacity_factor": "compute.moe_capacity_factor",
    "train.remat": "compute.remat",
}


def _plain(values):
  """ConfigDict (or FrozenConfigDict) -> dict; anything else unchanged."""
  return values.to_dict() if hasattr(values, "to_dict") else values


def migrate_legacy(d: Mapping[str, Any]) -> dict[str, Any]:
  """A root config dict as saved by older runs -> today's layout (a new dict).

  Each `MOVED` field found is taken out of its old section and put at its new place, unless
  the new place is already set; fields absent from `d` are left to the defaults of
  `run_config_from_dict`. Used on configs read back from a workdir (checkpoint meta
  "config"); for the model section alone (`model_config.json`) pass {"model": saved}.
  """
  out = copy.deepcopy(dict(_plain(d)))
  for old, new in MOVED.items():
    *path, name = old.split(".")
    section = out
    for key in path:
      section = section.get(key) if isinstance(section, dict) else None
    if not isinstance(section, dict) or name not in section:
      continue
    value = section.pop(name)
    new_section, new_name = new.split(".")
    out.setdefault(new_section, {}).setdefault(new_name, value)
  return out


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_num(v) -> bool:
  return _is_int(v) or isinstance(v, (float, np.floating))


def _join(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix else name


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
    value = _plain(value)
    require(isinstance(value, Mapping) and all(isinstance(k, str) for k in value), field,
            value, "a dict with string keys")
    return {k: _coerce(args[1], v, _join(field, k)) for k, v in value.items()}
  if tp is bool:
    require(isinstance(value, (bool, np.bool_)), field, value, "True or False")
    return bool(value)
  if tp is int:
    require(_is_int(value), field, value, "an integer")
    return int(value)
  if tp is float:
    require(_is_num(value), field, value, "a number")
    return float(value)
  if tp is str:
    require(isinstance(value, str), field, value, "a string")
    return value
  return value


def from_dict(cls, values: Mapping[str, Any] | None, prefix: str = ""):
  """THE config checker: a frozen dataclass `cls` from a (ConfigDict or) dict.

  Fields missing from `values` take their defaults; unknown fields, a field that moved
  (`MOVED`) and values of the wrong type raise `ConfigError` naming `prefix.field`; nested
  dataclasses, tuples and dicts are built recursively; `cls.__post_init__` checks ranges.
  """
  values = _plain({} if values is None else values)
  require(isinstance(values, Mapping), prefix or "config", values,
          f"a dict of {cls.__name__} fields")
  hints = typing.get_type_hints(cls)
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
