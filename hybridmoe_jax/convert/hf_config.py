"""Hugging Face Kimi-Linear `config.json` <-> our `ModelConfig` (model_type "kimi_linear").

The HF fields are those of the released Kimi-Linear-48B-A3B config (the names mlx-lm's
`kimi_linear.ModelArgs` reads). Every field that changes the forward is mapped or checked: a
value we cannot express raises `UnsupportedConfig` naming the field, its value and what is
allowed, before any weight is touched. Fields without effect on the forward (token ids,
rope_theta of a NoPE model, max length, ...) are kept for the export back (`passthrough`),
and an imported config.json that still describes the model is exported back unchanged
(`export_config`: a null `num_shared_experts`, an unread `head_dim`, a top-1 model's
`moe_renormalize` stay as they were).

Mapping (HF -> ours):
  hidden_size -> d_model; num_hidden_layers -> num_layers; rms_norm_eps -> norm_eps (every
  norm); linear_attn_config {num_heads, head_dim, short_conv_kernel_size, kda_layers
  (1-based)} -> kda.{num_heads = num_v_heads, head_dim = v_head_dim, conv_size},
  layer_kinds, with the unbounded gate, rank-head_dim decay and output gates (f_a/f_b,
  g_a/g_b); num_attention_heads, kv_lora_rank, qk_nope/qk_rope/v_head_dim -> mla.*
  (mla_use_nope must be true, no q_lora, no output gate); num_experts,
  num_experts_per_token, moe_intermediate_size, num_shared_experts, routed_scaling_factor,
  first_k_dense_replace, intermediate_size -> moe.* (SwiGLU experts, no latent MoE);
  moe_renormalize (and top-1, never renormalised) -> renormalize.
Our side has no AttnRes and no vision tower. A converted model balances with "sign" (the
original's bias rule); QB exports too: the rule only trains the bias, which enters the
forward the same way (sigmoid + bias chooses, the unbiased scores weigh).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from hybridmoe_jax.config import (AttnResConfig, ConfigError, KDAConfig, MLAConfig, MoEConfig,
                                  ModelConfig, is_int, is_number)

CONFIG_JSON = "config.json"
MODEL_TYPE = "kimi_linear"
ARCHITECTURES = ["KimiLinearForCausalLM"]
LINEAR_ATTN_KEYS = {"num_heads", "head_dim", "short_conv_kernel_size", "kda_layers",
                    "full_attn_layers"}
# Mapped (or checked) fields of config.json; everything else is passed through untouched.
MAPPED = {"model_type", "vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps",
          "linear_attn_config", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
          "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim", "mla_use_nope",
          "num_experts", "num_experts_per_token", "moe_intermediate_size",
          "num_shared_experts", "moe_router_activation_func", "moe_renormalize",
          "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq",
          "use_grouped_topk", "num_expert_group", "topk_group", "intermediate_size",
          "tie_word_embeddings", "hidden_act", "quantization_config", "architectures",
          "num_key_value_heads"}


def read_hf_config(hf_dir: str) -> dict[str, Any]:
  """An HF dir's config.json. FileNotFoundError / ValueError (one line) when absent / not
  JSON."""
  path = os.path.join(hf_dir, CONFIG_JSON)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{hf_dir} has no {CONFIG_JSON}: not a Hugging Face model dir")
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except ValueError as e:
      raise ValueError(f"{path} is not JSON ({e})") from None


class UnsupportedConfig(ConfigError):
  """A config value one side can express and the other cannot (the message names it)."""


def _unsupported(field: str, value: Any, allowed: str, why: str = "") -> UnsupportedConfig:
  return UnsupportedConfig(f"config field `{field}` = {value!r} is not supported: allowed "
                           f"{allowed}{f' ({why})' if why else ''}")


def _get(hf: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False):
  if key not in hf or hf[key] is None:
    if required:
      raise UnsupportedConfig(f"config.json has no field `{key}` (needed for Kimi-Linear)")
    return default
  return hf[key]


# The JSON type of the fields read here before our config checks them (a string or a list
# there would otherwise fail deep inside with a TypeError, or a "false" string read as true).
_TYPES = {"int": (is_int, "an integer"), "number": (is_number, "a number"),
          "bool": (lambda v: isinstance(v, bool), "true or false")}


def _get_as(hf: Mapping[str, Any], key: str, kind: str, default: Any = None, *,
            required: bool = False):
  """`_get`, with a value of the wrong JSON type refused naming the field."""
  value = _get(hf, key, default, required=required)
  ok, allowed = _TYPES[kind]
  if value is not None and not ok(value):
    raise _unsupported(key, value, allowed)
  return value


def _layer_list(lin: Mapping[str, Any], key: str):
  value = lin.get(key)
  if value is not None and not (isinstance(value, list) and all(is_int(i) for i in value)):
    raise _unsupported(f"linear_attn_config.{key}", value, "a list of 1-based layer numbers")
  return value


# Our fields -> the config.json fields they are read from (named in our config's errors).
HF_FIELDS = {
    "model.vocab_size": "vocab_size", "model.d_model": "hidden_size",
    "model.num_layers": "num_hidden_layers", "model.norm_eps": "rms_norm_eps",
    "model.layer_kinds": "linear_attn_config.kda_layers",
    "model.kda.num_heads": "linear_attn_config.num_heads",
    "model.kda.num_v_heads": "linear_attn_config.num_heads",
    "model.kda.head_dim": "linear_attn_config.head_dim",
    "model.kda.v_head_dim": "linear_attn_config.head_dim",
    "model.kda.gate_rank": "linear_attn_config.head_dim",
    "model.kda.conv_size": "linear_attn_config.short_conv_kernel_size",
    "model.mla.num_heads": "num_attention_heads", "model.mla.kv_lora_rank": "kv_lora_rank",
    "model.mla.qk_nope_head_dim": "qk_nope_head_dim (or head_dim)",
    "model.mla.qk_rope_head_dim": "qk_rope_head_dim",
    "model.mla.v_head_dim": "v_head_dim (or head_dim)",
    "model.moe.num_experts": "num_experts",
    "model.moe.experts_per_token": "num_experts_per_token",
    "model.moe.expert_intermediate": "moe_intermediate_size",
    "model.moe.shared_intermediate": "moe_intermediate_size",
    "model.moe.num_shared_experts": "num_shared_experts",
    "model.moe.routed_scale": "routed_scaling_factor",
    "model.moe.first_dense_layers": "first_k_dense_replace",
    "model.moe.dense_intermediate": "intermediate_size",
}


def model_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """A Kimi-Linear config.json dict -> our validated ModelConfig.

  Raises:
    UnsupportedConfig: a field whose value our model cannot express (named, with the value).
    ConfigError: a mapped value outside our own allowed range (naming the HF field too).
  """
  if not isinstance(hf, Mapping):
    raise UnsupportedConfig(f"config.json holds a {type(hf).__name__}, not a JSON object")
  try:
    return _model_config_from_hf(hf)
  except UnsupportedConfig:
    raise
  except ConfigError as e:
    if e.field in HF_FIELDS:
      raise ConfigError(f"config.json field `{HF_FIELDS[e.field]}`: {e}", e.field) from None
    raise


def _model_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  if hf.get("model_type") != MODEL_TYPE:
    raise _unsupported("model_type", hf.get("model_type"), repr(MODEL_TYPE))
  checks = [
      ("tie_word_embeddings", _get(hf, "tie_word_embeddings", False), lambda v: v is False,
       "false", "our LM head is a separate matrix"),
      ("hidden_act", _get(hf, "hidden_act", "silu"), lambda v: v == "silu", "'silu'",
       "SwiGLU experts"),
      ("quantization_config", _get(hf, "quantization_config"), lambda v: v is None, "absent",
       "quantized checkpoints are not read"),
      ("mla_use_nope", _get(hf, "mla_use_nope", False), lambda v: v is True, "true",
       "our MLA has no rotary embedding"),
      ("q_lora_rank", _get(hf, "q_lora_rank"), lambda v: not v, "null or 0",
       "Kimi-Linear projects queries directly"),
      ("moe_router_activation_func", _get(hf, "moe_router_activation_func", "sigmoid"),
       lambda v: v == "sigmoid", "'sigmoid'", "our router is sigmoid"),
      ("moe_layer_freq", _get(hf, "moe_layer_freq", 1), lambda v: v == 1, "1",
       "every layer after the dense ones is MoE"),
      ("num_experts", _get_as(hf, "num_experts", "int", required=True), lambda v: v >= 2,
       ">= 2", "an all-dense model is not mapped"),
  ]
  for field, value, ok, allowed, why in checks:
    if not ok(value):
      raise _unsupported(field, value, allowed, why)
  groups = _get_as(hf, "num_expert_group", "int", 1)
  topk_group = _get_as(hf, "topk_group", "int", 1)
  if _get_as(hf, "use_grouped_topk", "bool", True) and groups > 1 and topk_group < groups:
    raise _unsupported("topk_group", topk_group, f"num_expert_group={groups} (no group "
                       "limit) or num_expert_group = 1", "grouped top-k routing is not built")
  lin = _get(hf, "linear_attn_config", required=True)
  if not isinstance(lin, Mapping):
    raise _unsupported("linear_attn_config", lin, "a JSON object")
  unknown = sorted(set(lin) - LINEAR_ATTN_KEYS)
  if unknown:
    raise _unsupported(f"linear_attn_config.{unknown[0]}", lin[unknown[0]],
                       f"only the fields {sorted(LINEAR_ATTN_KEYS)}")
  n_layers = _get_as(hf, "num_hidden_layers", "int", required=True)
  kda_layers = set(_layer_list(lin, "kda_layers") or [])
  bad = sorted(i for i in kda_layers if not 1 <= i <= n_layers)   # ints: _layer_list
  if bad:
    raise _unsupported("linear_attn_config.kda_layers", sorted(kda_layers),
                       f"1-based layer numbers in [1, {n_layers}]")
  kinds = tuple("kda" if i + 1 in kda_layers else "mla" for i in range(n_layers))
  full = _layer_list(lin, "full_attn_layers")
  if full is not None and sorted(full) != [i + 1 for i, k in enumerate(kinds) if k == "mla"]:
    raise _unsupported("linear_attn_config.full_attn_layers", full,
                       "exactly the layers not in kda_layers")
  head_dim = _get(hf, "head_dim")
  k_heads, k_dim = lin.get("num_heads"), lin.get("head_dim")
  kda = KDAConfig(num_heads=k_heads, num_v_heads=k_heads, head_dim=k_dim, v_head_dim=k_dim,
                  conv_size=lin.get("short_conv_kernel_size", 4), gate="unbounded",
                  gate_rank=k_dim, output_gate_rank=0)
  mla = MLAConfig(num_heads=_get(hf, "num_attention_heads", required=True), q_lora_rank=0,
                  kv_lora_rank=_get(hf, "kv_lora_rank", required=True),
                  qk_nope_head_dim=_get(hf, "qk_nope_head_dim", head_dim),
                  qk_rope_head_dim=_get(hf, "qk_rope_head_dim", 0),
                  v_head_dim=_get(hf, "v_head_dim", head_dim), output_gate=False)
  k = _get_as(hf, "num_experts_per_token", "int", 1)
  moe_width = _get(hf, "moe_intermediate_size", required=True)
  moe = MoEConfig(num_experts=hf["num_experts"], experts_per_token=k,
                  expert_intermediate=moe_width,
                  num_shared_experts=_get(hf, "num_shared_experts", 0),
                  shared_intermediate=moe_width, latent_dim=0, glu="swiglu",
                  routed_scale=float(_get_as(hf, "routed_scaling_factor", "number", 1.0)),
                  renormalize=bool(_get_as(hf, "moe_renormalize", "bool", True)) and k > 1,
                  first_dense_layers=_get(hf, "first_k_dense_replace", 0),
                  dense_intermediate=_get(hf, "intermediate_size", required=True),
                  balancing="sign")
  return ModelConfig(vocab_size=_get(hf, "vocab_size", required=True),
                     d_model=_get(hf, "hidden_size", required=True), num_layers=n_layers,
                     layer_kinds=kinds,
                     norm_eps=float(_get_as(hf, "rms_norm_eps", "number", 1e-6)),
                     kda=kda, mla=mla, moe=moe, attnres=AttnResConfig(enabled=False))


def passthrough(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The config.json fields that do not change the forward (kept on the way back)."""
  return {k: v for k, v in hf.items() if k not in MAPPED}


def hf_config_from_model(cfg: ModelConfig, extra: Mapping[str, Any] | None = None
                         ) -> dict[str, Any]:
  """Our ModelConfig -> a Kimi-Linear config.json dict (`extra`: passthrough fields).

  Raises:
    UnsupportedConfig: naming the first of our fields HF Kimi-Linear cannot express.
  """
  kda, mla, moe = cfg.kda, cfg.mla, cfg.moe
  checks = [
      ("model.attnres.enabled", cfg.attnres.enabled, not cfg.attnres.enabled, "False",
       "Kimi-Linear has plain residuals, no attention residuals"),
      ("model.vision.enabled", cfg.vision.enabled, not cfg.vision.enabled, "False",
       "Kimi-Linear is text only"),
      ("model.kda.gate", kda.gate, kda.gate == "unbounded", "'unbounded'",
       "Kimi-Linear's gate is -exp(A_log) softplus(.), not the bounded lb sigmoid(.)"),
      ("model.kda.num_v_heads", kda.num_v_heads, kda.num_v_heads == kda.num_heads,
       f"num_heads={kda.num_heads}", "no grouped value heads"),
      ("model.kda.v_head_dim", kda.v_head_dim, kda.v_head_dim == kda.head_dim,
       f"head_dim={kda.head_dim}", "one head dim for q, k and v"),
      ("model.kda.gate_rank", kda.gate_rank, kda.decay_rank == kda.head_dim,
       f"0 or head_dim={kda.head_dim}", "the decay projection has rank head_dim"),
      ("model.kda.output_gate_rank", kda.output_gate_rank, kda.out_gate_rank == kda.head_dim,
       f"0 or head_dim={kda.head_dim}", "the output gate is low rank, rank head_dim"),
      ("model.mla.q_lora_rank", mla.q_lora_rank, mla.q_lora_rank == 0, "0",
       "Kimi-Linear projects queries directly"),
      ("model.mla.output_gate", mla.output_gate, not mla.output_gate, "False",
       "Kimi-Linear's MLA has no output gate"),
      ("model.mla.rope_theta", mla.rope_theta, not mla.rope_theta, "0 (NoPE)",
       "Kimi-Linear's MLA has no positions (mla_use_nope)"),
      ("model.mla.logn_base", mla.logn_base, not mla.logn_base, "0",
       "Kimi-Linear's MLA has a plain softmax"),
      ("model.moe.glu", moe.glu, moe.glu == "swiglu", "'swiglu'",
       "SiTU-GLU has no HF equivalent"),
      ("model.moe.latent_dim", moe.latent_dim, moe.latent_dim == 0, "0",
       "Kimi-Linear's experts run at full width"),
      ("model.moe.renormalize", moe.renormalize, moe.experts_per_token > 1 or
       not moe.renormalize, "False with experts_per_token=1",
       "HF never renormalises a single route"),
  ]
  for field, value, ok, allowed, why in checks:
    if not ok:
      raise _unsupported(field, value, allowed, why)
  shared = moe.num_shared_experts * moe.shared_intermediate
  if shared % moe.expert_intermediate:
    raise _unsupported("model.moe.shared_intermediate", moe.shared_intermediate,
                       f"a width with num_shared_experts * shared_intermediate a multiple of "
                       f"expert_intermediate={moe.expert_intermediate}",
                       "HF sizes the shared expert as n * moe_intermediate_size")
  kda_layers = [i + 1 for i, k in enumerate(cfg.layer_kinds) if k == "kda"]
  out = dict(extra or {})
  out.update({
      "architectures": ARCHITECTURES, "model_type": MODEL_TYPE,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.num_layers, "rms_norm_eps": cfg.norm_eps,
      "hidden_act": "silu", "tie_word_embeddings": False,
      "linear_attn_config": {"num_heads": kda.num_heads, "head_dim": kda.head_dim,
                             "short_conv_kernel_size": kda.conv_size,
                             "kda_layers": kda_layers,
                             "full_attn_layers": [i + 1 for i, k in enumerate(cfg.layer_kinds)
                                                  if k == "mla"]},
      "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads,
      "head_dim": mla.qk_nope_head_dim, "q_lora_rank": None,
      "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
      "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
      "mla_use_nope": True,
      "num_experts": moe.num_experts, "num_experts_per_token": moe.experts_per_token,
      "moe_intermediate_size": moe.expert_intermediate,
      # null, not 0, without shared experts: Transformers builds a shared MLP for any non-null
      # count (a zero-width one for 0).
      "num_shared_experts": shared // moe.expert_intermediate or None,
      "moe_router_activation_func": "sigmoid", "moe_renormalize": moe.renormalize,
      "routed_scaling_factor": moe.routed_scale,
      "first_k_dense_replace": moe.first_dense_layers, "moe_layer_freq": 1,
      "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
      "intermediate_size": moe.dense_intermediate,
  })
  return out


def _forward_only(cfg: ModelConfig) -> ModelConfig:
  """`cfg` without the fields that only train (the balancing rule: "sign" on import)."""
  return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, balancing="sign"))


def export_config(cfg: ModelConfig, imported: Mapping[str, Any] | None = None
                  ) -> dict[str, Any]:
  """The config.json to write for `cfg`.

  imported: the config.json the model was converted from (`convert.from_hf` keeps it beside
    the export), or only its passthrough fields (exports written before it was kept whole).
  When `imported` is a whole Kimi-Linear config that maps to this same model it is returned
  unchanged, field for field, so import -> export -> import is the identity on config.json.
  Otherwise the mapped fields are generated from `cfg` and `imported`'s fields without effect
  on the forward are kept.

  Raises:
    UnsupportedConfig: naming the first of our fields HF Kimi-Linear cannot express.
  """
  imported = dict(imported or {})
  if imported.get("model_type") == MODEL_TYPE:
    try:
      same = _forward_only(model_config_from_hf(imported)) == _forward_only(cfg)
    except ConfigError:
      same = False
    if same:
      return json.loads(json.dumps(imported))    # a deep copy of plain JSON values
  return hf_config_from_model(cfg, passthrough(imported))


def model_dict(cfg: ModelConfig) -> dict[str, Any]:
  """The JSON dict of a ModelConfig (what model_config.json holds)."""
  return dataclasses.asdict(cfg)
