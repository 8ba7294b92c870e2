"""Kimi-Linear-48B-A3B (DESIGN s0): 48B total / 3B active, unbounded gate, no AttnRes."""

from hybridmoe_jax.config.run import default_config


def get_config():
  config = default_config()
  m = config.model
  m.vocab_size = 163840
  m.d_model = 2304
  m.num_layers = 27               # MLA at 1-based 4, 8, ..., 24 and 27
  m.kda.num_heads = 32
  m.kda.num_v_heads = 32
  m.kda.head_dim = 128
  m.kda.v_head_dim = 128
  m.kda.gate = "unbounded"        # -exp(A_log) * softplus(.)
  m.kda.gate_rank = 128
  m.kda.output_gate_rank = 0      # low-rank output gate, rank = head dim
  m.mla.num_heads = 32
  m.mla.q_lora_rank = 0
  m.mla.kv_lora_rank = 512
  m.mla.qk_nope_head_dim = 128
  m.mla.qk_rope_head_dim = 64
  m.mla.v_head_dim = 128
  m.mla.output_gate = False
  m.moe.num_experts = 256
  m.moe.experts_per_token = 8
  m.moe.expert_intermediate = 1024
  m.moe.num_shared_experts = 1
  m.moe.shared_intermediate = 1024
  m.moe.latent_dim = 0            # experts at full width
  m.moe.glu = "swiglu"
  m.moe.routed_scale = 2.446
  m.moe.first_dense_layers = 1
  m.moe.dense_intermediate = 9216
  m.moe.balancing = "sign"        # auxiliary-loss-free bias rule of the original model
  m.attnres.enabled = False
  config.compute.dtype = "bfloat16"
  return config
