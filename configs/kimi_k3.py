"""Kimi K3 flagship (DESIGN s0): 2.78T total / 104.2B active. For --dry_run and counting."""

from hybridmoe_jax.config.run import default_config


def get_config():
  config = default_config()
  m = config.model
  m.vocab_size = 163840
  m.d_model = 7168
  m.num_layers = 93               # MLA at 1-based 4, 8, ..., 92 and 93: 69 KDA + 24 MLA
  m.norm_eps = 1e-5
  m.kda.num_heads = 96
  m.kda.num_v_heads = 96
  m.kda.head_dim = 128
  m.kda.v_head_dim = 128
  m.kda.gate = "bounded"
  m.kda.lower_bound = -5.0
  m.kda.gate_rank = 128           # low-rank decay projection, rank = head dim
  m.kda.output_gate_rank = -1     # full-rank output gate
  m.mla.num_heads = 96
  m.mla.q_lora_rank = 1536
  m.mla.kv_lora_rank = 512
  m.mla.qk_nope_head_dim = 128
  m.mla.qk_rope_head_dim = 64     # shared key slot, never rotated
  m.mla.v_head_dim = 128
  m.mla.output_gate = True
  m.moe.num_experts = 896
  m.moe.experts_per_token = 16
  m.moe.expert_intermediate = 3072
  m.moe.num_shared_experts = 2    # fused: one MLP of width 2 * 3072 = 6144
  m.moe.shared_intermediate = 3072
  m.moe.latent_dim = 3584         # latent MoE width
  m.moe.glu = "situ"
  m.moe.routed_scale = 1.0        # not published; set when converting a checkpoint
  m.moe.first_dense_layers = 1
  m.moe.dense_intermediate = 33792
  m.moe.balancing = "qb"
  m.attnres.enabled = True
  m.attnres.block_size = 12       # 8 blocks over 93 layers
  # Native vision tower (DESIGN s5), trained from scratch jointly with text; counted apart
  # from the 2.78T text model (python -m hybridmoe_jax.tools.describe --config=configs/kimi_k3.py).
  v = m.vision
  v.enabled = True
  v.patch_size = 14
  v.num_channels = 3
  v.width = 1024
  v.num_layers = 27
  v.num_heads = 16                # head dim 64
  v.mlp_dim = 4096                # 4 x width (not published)
  v.native_grid = 64              # 896-pixel native side; other sizes interpolate
  v.projector_dim = 0             # projector 4 * 1024 -> 7168 -> 7168, then RMSNorm
  v.image_buckets = (224, 448, 896)
  v.max_images_per_row = 8
  config.compute.dtype = "bfloat16"
  # 93 layers: the repeating KDA/MLA period runs as one lax.scan over 22 stacked repeats
  # (model/stack.py), so the whole train step compiles (210 s deviceless, BENCHMARKS.md).
  config.compute.scan_layers = True
  # DESIGN s7: the flagship trains with Muon. Its optimizer state is one momentum per matrix
  # (AdamW: two moments), which is what lets the step fit v5p-2048: by the TPU compiler
  # (COMPILER ESTIMATE, BENCHMARKS.md "Kimi K3 fits v5p-2048 with Muon") 76.54 GiB per chip with Muon vs
  # 86.85 GiB with AdamW (85.5 usable) in the layout --config.mesh.fsdp=1
  # --config.mesh.context=16 --config.mesh.expert=64 --config.train.batch_size=1024
  # --config.train.grad_accum=16 --config.train.seq_len=4096 --config.compute.remat=full
  # --config.compute.moe_capacity_factor=1.25. Not built: per-head Muon for attention and
  # QK-clip (train/muon.py orthogonalizes each weight matrix whole).
  config.train.optimizer = "muon"
  return config
