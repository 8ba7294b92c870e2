"""A random tiny Kimi-Linear checkpoint in the Hugging Face layout, built by the tests.

5 layers: KDA at 1-based 1, 3, 4 and MLA at 2 and 5; layer 0 dense, layers 1-4 MoE with
6 experts (top 2) + 1 shared; weights stored as BF16 like the release (A_log, dt_bias and
the correction bias float32), random but in the ranges a trained model has (decay rates
A in [1, 16], dt in [1e-3, 1e-1], norm gains near 1, a nonzero correction bias).
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from tests._support import save_safetensors


def tiny_hf_config(**overrides) -> dict:
  cfg = {
      "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
      "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 5, "rms_norm_eps": 1e-5,
      "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0,
      "model_max_length": 4096, "bos_token_id": 1, "eos_token_id": 2,
      "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                             "kda_layers": [1, 3, 4], "full_attn_layers": [2, 5]},
      "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "q_lora_rank": None,
      "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
      "mla_use_nope": True, "num_experts": 6, "num_experts_per_token": 2,
      "moe_intermediate_size": 16, "num_shared_experts": 1,
      "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
      "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1,
      "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
      "intermediate_size": 48,
  }
  cfg.update(overrides)
  return cfg


def tiny_hf_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """Every tensor of `cfg`'s checkpoint, HF names and layouts."""
  rng = np.random.default_rng(seed)
  d, v = cfg["hidden_size"], cfg["vocab_size"]
  bf16 = lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
  lin = lambda o, i: bf16(rng.normal(size=(o, i)) * i ** -0.5)
  gain = lambda n: bf16(1 + 0.1 * rng.normal(size=(n,)))
  w = {"model.embed_tokens.weight": bf16(rng.normal(size=(v, d))),
       "model.norm.weight": gain(d), "lm_head.weight": lin(v, d)}
  lin_cfg = cfg["linear_attn_config"]
  h, k, cw = lin_cfg["num_heads"], lin_cfg["head_dim"], lin_cfg["short_conv_kernel_size"]
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    w[p + "input_layernorm.weight"] = gain(d)
    w[p + "post_attention_layernorm.weight"] = gain(d)
    a = p + "self_attn."
    if i + 1 in lin_cfg["kda_layers"]:
      for x in "qkv":
        w[a + f"{x}_proj.weight"] = lin(h * k, d)
        w[a + f"{x}_conv1d.weight"] = bf16(rng.normal(size=(h * k, 1, cw)) * 0.5)
      w[a + "f_a_proj.weight"], w[a + "f_b_proj.weight"] = lin(k, d), lin(h * k, k)
      w[a + "g_a_proj.weight"], w[a + "g_b_proj.weight"] = lin(k, d), lin(h * k, k)
      w[a + "b_proj.weight"] = lin(h, d)
      w[a + "A_log"] = np.log(rng.uniform(1, 16, (1, 1, h, 1))).astype(np.float32)
      dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), (h * k,)))
      w[a + "dt_bias"] = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
      w[a + "o_norm.weight"] = gain(k)
      w[a + "o_proj.weight"] = lin(d, h * k)
    else:
      n, r = cfg["num_attention_heads"], cfg["kv_lora_rank"]
      dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
      w[a + "q_proj.weight"] = lin(n * (dn + dr), d)
      w[a + "kv_a_proj_with_mqa.weight"] = lin(r + dr, d)
      w[a + "kv_a_layernorm.weight"] = gain(r)
      w[a + "kv_b_proj.weight"] = lin(n * (dn + dv), r)
      w[a + "o_proj.weight"] = lin(d, n * dv)
    if i < cfg["first_k_dense_replace"]:
      f, m = cfg["intermediate_size"], p + "mlp."
      w[m + "gate_proj.weight"], w[m + "up_proj.weight"] = lin(f, d), lin(f, d)
      w[m + "down_proj.weight"] = lin(d, f)
      continue
    e, f, m = cfg["num_experts"], cfg["moe_intermediate_size"], p + "block_sparse_moe."
    w[m + "gate.weight"] = lin(e, d)
    w[m + "gate.e_score_correction_bias"] = (0.05 * rng.normal(size=(e,))).astype(np.float32)
    for j in range(e):
      w[m + f"experts.{j}.w1.weight"], w[m + f"experts.{j}.w3.weight"] = lin(f, d), lin(f, d)
      w[m + f"experts.{j}.w2.weight"] = lin(d, f)
    s = f * (cfg["num_shared_experts"] or 0)     # null: no shared expert
    if s:
      w[m + "shared_experts.gate_proj.weight"] = lin(s, d)
      w[m + "shared_experts.up_proj.weight"] = lin(s, d)
      w[m + "shared_experts.down_proj.weight"] = lin(d, s)
  return w


def write_hf_dir(path, cfg: dict | None = None, weights: dict | None = None, *,
                 shards: int = 2, seed: int = 0) -> str:
  """Write config.json, the weights (in `shards` files + index when > 1) and a tokenizer file."""
  cfg = cfg or tiny_hf_config()
  weights = tiny_hf_weights(cfg, seed) if weights is None else weights
  path = str(path)
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"model_max_length": 4096}, f)
  names = list(weights)
  parts = [names[i::shards] for i in range(shards)]
  if shards == 1:
    save_safetensors(os.path.join(path, "model.safetensors"), weights, metadata={"format": "pt"})
    return path
  weight_map = {}
  for i, part in enumerate(parts):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    save_safetensors(os.path.join(path, file), {n: weights[n] for n in part}, metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return path
