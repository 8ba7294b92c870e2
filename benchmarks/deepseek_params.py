"""deepseek2-16b's parameters, for benchmarks/maxtext_anchor.py: counted from its MaxText
config (the MFU's active parameters) and from a compiled model's abstract state (the check
that the formula counts what MaxText builds)."""

from __future__ import annotations

def count_params(c: dict) -> dict:
  """deepseek2-16b's parameters from its MaxText config `c` (a dict of config values): per
  layer MLA (q_lora_rank 0: wq; wkv_a + kv norm; wkv_b; out), 2 RMSNorms, a dense SwiGLU
  (first_num_dense_layers) or a MoE block (router gate, num_experts routed SwiGLU experts of
  moe_mlp_dim, shared_experts x moe_mlp_dim shared SwiGLU); embedding, final norm, LM head
  (logits_via_embedding false). Active = total - input embedding - routed x (1 - k/E)."""
  d, L, dense = c["emb_dim"], c["num_decoder_layers"], c["first_num_dense_layers"]
  h, nope, rope, vd, r = (c["num_query_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                          c["v_head_dim"], c["kv_lora_rank"])
  assert c["q_lora_rank"] == 0, "counted for deepseek2-16b (q_lora_rank 0)"
  attn = d * h * (nope + rope) + d * (r + rope) + r + r * h * (nope + vd) + h * vd * d
  norms = 2 * d
  dense_mlp = 3 * d * c["mlp_dim"]
  gate = d * c["num_experts"]
  routed = c["num_experts"] * 3 * d * c["moe_mlp_dim"]
  shared = 3 * d * c["shared_experts"] * c["moe_mlp_dim"]
  embed = c["vocab_size"] * d
  head = 0 if c["logits_via_embedding"] else c["vocab_size"] * d
  moe_layers = L - dense
  total = (embed + head + d + L * (attn + norms) + dense * dense_mlp
           + moe_layers * (gate + routed + shared))
  routed_all = moe_layers * routed
  routed_active = routed_all * c["num_experts_per_tok"] // c["num_experts"]
  active = total - embed - routed_all + routed_active
  return {"total": total, "active": active, "active_with_input_embedding": active + embed,
          "input_embedding": embed, "lm_head": head, "routed_experts": routed_all,
          "routed_active": routed_active, "per_layer_attention": attn,
          "dense_mlp": dense_mlp, "per_moe_layer": gate + routed + shared, "layers": L,
          "formula": ("total = embed + head + final norm + L x (MLA + 2 norms) + dense x SwiGLU"
                      " + (L - dense) x (gate + E routed + shared); active = total - embed"
                      " - routed + routed x k/E")}


CONFIG_KEYS = ("emb_dim", "num_decoder_layers", "first_num_dense_layers", "num_query_heads",
               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank",
               "q_lora_rank", "mlp_dim", "moe_mlp_dim", "num_experts", "num_experts_per_tok",
               "shared_experts", "vocab_size", "logits_via_embedding", "remat_policy",
               "weight_dtype", "dtype", "opt_type", "sparse_matmul", "megablox",
               "capacity_factor", "attention", "scan_layers", "per_device_batch_size",
               "max_target_length", "mesh_axes", "ici_fsdp_parallelism",
               "ici_expert_parallelism", "shard_mode", "gradient_accumulation_steps")


def _tree_params(abstract_state, num_experts: int) -> dict:
  """Parameter count of the compiled model's abstract state (the `model` half of MaxText's
  TrainStateNNX, less its nnx.Rngs keys and counters): total, and the routed experts' (wi_0 /
  wi_1 / wo under a MoeBlock, with a leading num_experts axis)."""
  import jax  # pylint: disable=import-outside-toplevel
  state = abstract_state.model if hasattr(abstract_state, "model") else abstract_state["model"]
  total = routed = 0
  names = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    shape = getattr(leaf, "shape", None)
    if shape is None:
      continue
    n = 1
    for s in shape:
      n *= int(s)
    keys = [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path]
    if "rngs" in keys or "key" in str(getattr(leaf, "dtype", "")):
      continue  # nnx.Rngs' keys and counters, not parameters
    total += n
    if any(k.startswith("MoeBlock") for k in keys) and \
        any(k in ("wi_0", "wi_1", "wo") for k in keys) and shape and int(shape[0]) == num_experts:
      routed += n
    names.append(("/".join(keys), tuple(int(s) for s in shape)))
  return {"total": total, "routed_experts": routed, "leaves": len(names)}
