"""~100M-parameter hybrid MoE for a single accelerator or a patient CPU."""

from hybridmoe_jax.config.run import default_config


def get_config():
  config = default_config()
  m = config.model
  m.vocab_size = 259              # byte tokenizer
  m.d_model = 512
  m.num_layers = 8                # MLA at layers 4 and 8
  m.kda.num_heads = 4
  m.kda.num_v_heads = 4
  m.kda.head_dim = 128
  m.kda.v_head_dim = 128
  m.mla.num_heads = 8
  m.mla.kv_lora_rank = 128
  m.mla.qk_nope_head_dim = 64
  m.mla.qk_rope_head_dim = 32
  m.mla.v_head_dim = 64
  m.moe.num_experts = 64
  m.moe.experts_per_token = 4
  m.moe.expert_intermediate = 224
  m.moe.num_shared_experts = 1
  m.moe.shared_intermediate = 1024
  m.moe.latent_dim = 256
  m.moe.first_dense_layers = 1
  m.moe.dense_intermediate = 2048
  m.attnres.block_size = 2
  return config
