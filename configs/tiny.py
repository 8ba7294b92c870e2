"""Tiny hybrid MoE for CPU: 4 layers (3 KDA + 1 MLA), 8 experts top-2 + 1 shared, bytes.

The byte vocabulary with the chat roles (`byte_chat`, 266 ids): the README's own run
(`runs/default`) can then be served on /v1/chat/completions and used by `lm.chat` and the
chat REPL. Presets that quote figures measured with the plain byte vocabulary (259 ids)
set `data.tokenizer = "byte"` and `model.vocab_size = 259` themselves.
"""

from hybridmoe_jax.config.run import default_config


def get_config():
  config = default_config()
  m = config.model
  config.data.tokenizer = "byte_chat"   # 256 bytes + pad/bos/eos + 7 chat roles
  m.vocab_size = 266
  m.d_model = 64
  m.num_layers = 4                # MLA at the last layer, KDA elsewhere
  m.kda.num_heads = 2
  m.kda.num_v_heads = 2
  m.kda.head_dim = 32
  m.kda.v_head_dim = 32
  m.mla.num_heads = 2
  m.mla.kv_lora_rank = 32
  m.mla.qk_nope_head_dim = 16
  m.mla.qk_rope_head_dim = 8
  m.mla.v_head_dim = 16
  m.moe.num_experts = 8
  m.moe.experts_per_token = 2
  m.moe.expert_intermediate = 64
  m.moe.num_shared_experts = 1
  m.moe.shared_intermediate = 64
  m.moe.latent_dim = 32           # routed experts run at half width
  m.moe.first_dense_layers = 1
  m.moe.dense_intermediate = 128
  m.attnres.block_size = 2
  config.compute.kda_chunk_size = 64
  # The embedded default run (`python run_train.py`) uses the `train` defaults of
  # hybridmoe_jax/config/run.py: 300 steps of 8 x 256 tokens, loss ~6.1 -> ~1.4 on 2 cores.
  return config
