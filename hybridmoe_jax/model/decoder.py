"""The hybrid decoder: embedding -> [mixer, FFN] x L with Block AttnRes -> norm -> LM head.

Conventions: B batch, T tokens, d width, E routed experts. tokens/segment_ids [B, T] int32;
segment id 0 marks padding (excluded from routing statistics), and tokens of different
segments never interact (KDA state resets, attention masks, conv taps).

Vision (cfg.vision.enabled): per row up to M images padded to one S x S bucket,
images [B, M, S, S, C] float, image_grid [B, M, 2] int32 (real patch rows/cols, 0 = empty
slot) and image_index [B, T] int32 (-1 for text; else the flat index m * K + r * S/2p + c
of the merged image token that replaces this placeholder, K = (S/2p)^2). The tower runs on
every image slot and its outputs replace the placeholder embeddings (`embed_inputs`).
"""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, ModelConfig
from hybridmoe_jax.layers.attnres import BlockStream, DepthMix, num_blocks
from hybridmoe_jax.layers.kda import KDALayer
from hybridmoe_jax.layers.linear import linear
from hybridmoe_jax.layers.mla import MLALayer
from hybridmoe_jax.layers.moe import GLUMLP, MoE
from hybridmoe_jax.layers.norms import RMSNorm
from hybridmoe_jax.layers.vision import VisionTower

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderLayer(nnx.Module):
  """Pre-norm mixer (KDA or MLA) then pre-norm FFN (dense or MoE), each fed by AttnRes."""

  def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs,
               compute: ComputeConfig = ComputeConfig(), moe_dispatch=None):
    d, eps, dtype = cfg.d_model, cfg.norm_eps, cfg.dtype
    self.index = index
    self.kind = cfg.layer_kinds[index]
    self.block = index // cfg.attnres.block_size + 1
    self.mixer_norm = RMSNorm(d, eps=eps)
    mixer_cls, mixer_cfg = (KDALayer, cfg.kda) if self.kind == "kda" else (MLALayer, cfg.mla)
    self.mixer = mixer_cls(d, mixer_cfg, norm_eps=eps, dtype=dtype, rngs=rngs)
    self.ffn_norm = RMSNorm(d, eps=eps)
    self.is_moe = cfg.is_moe_layer(index)
    if self.is_moe:
      self.ffn = MoE(d, cfg.moe, norm_eps=eps, compute=compute, rngs=rngs, dispatch=moe_dispatch)
    else:
      self.ffn = GLUMLP(d, cfg.moe.dense_intermediate, glu=cfg.moe.glu, dtype=dtype, rngs=rngs)
    self.attnres = cfg.attnres.enabled
    if self.attnres:
      self.mixer_mix = DepthMix(d, eps=eps)
      self.ffn_mix = DepthMix(d, eps=eps)

  def __call__(self, stream, segment_ids: jax.Array, valid: jax.Array):
    """stream: BlockStream (AttnRes) or the residual x [B, T, d] -> (stream, moe stats)."""
    h = self.mixer_mix(stream) if self.attnres else stream
    out = self.mixer(self.mixer_norm(h), segment_ids=segment_ids)
    stream = stream.add(self.block, out) if self.attnres else stream + out
    h = self.ffn_mix(stream) if self.attnres else stream
    if self.is_moe:
      out, stats = self.ffn(self.ffn_norm(h), mask=valid)
    else:
      out, stats = self.ffn(self.ffn_norm(h)), None
    stream = stream.add(self.block, out) if self.attnres else stream + out
    return stream, stats


class HybridLM(nnx.Module):
  """Decoder-only hybrid KDA/MLA sparse-MoE language model."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
               compute: ComputeConfig = ComputeConfig(), moe_dispatch=None):
    self.cfg = cfg
    self.remat = compute.remat
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.dtype(cfg.dtype),
                           param_dtype=jnp.float32,
                           embedding_init=nnx.initializers.normal(stddev=1.0), rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, i, compute=compute, rngs=rngs,
                                         moe_dispatch=moe_dispatch)
                            for i in range(cfg.num_layers)])
    if cfg.vision.enabled:
      self.vision = VisionTower(cfg.vision, cfg.d_model, eps=cfg.norm_eps, dtype=cfg.dtype,
                                rngs=rngs)
    if cfg.attnres.enabled:
      self.final_mix = DepthMix(cfg.d_model, eps=cfg.norm_eps)
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    # The head runs in fp32 so logits (and the loss) are fp32 whatever the compute dtype.
    self.lm_head = linear(cfg.d_model, cfg.vocab_size, dtype="float32", rngs=rngs)

  def image_features(self, images: jax.Array, image_grid: jax.Array) -> jax.Array:
    """images [B, M, S, S, C], image_grid [B, M, 2] -> [B, M*K, d] projected image tokens."""
    b, m, s, _, c = images.shape
    feats = self.vision(images.reshape(b * m, s, s, c), image_grid.reshape(b * m, 2))
    return feats.reshape(b, m * feats.shape[1], feats.shape[2])

  def embed_inputs(self, tokens: jax.Array, images: jax.Array | None = None,
                   image_grid: jax.Array | None = None,
                   image_index: jax.Array | None = None) -> jax.Array:
    """tokens [B, T] -> input embeddings [B, T, d]; placeholders (image_index >= 0) take the
    projected image token they index (see the module docstring)."""
    x = self.embed(tokens)
    if images is None:
      return x
    if not self.cfg.vision.enabled:
      raise ValueError("images were given to a model without a vision tower "
                       "(model.vision.enabled = False)")
    feats = self.image_features(images, image_grid)
    picked = jnp.take_along_axis(feats, jnp.maximum(image_index, 0)[..., None], axis=1)
    return jnp.where(image_index[..., None] >= 0, picked.astype(x.dtype), x)

  def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
               images: jax.Array | None = None, image_grid: jax.Array | None = None,
               image_index: jax.Array | None = None) -> tuple[jax.Array, dict[str, Any]]:
    """tokens [B, T] int32 (+ optional images, see the module docstring)
    -> (logits [B, T, vocab] fp32, aux).

    aux["moe"]: the routing statistics of every MoE layer (`layers.balancing.routing_stats`),
    shaped like the pure dict of the RoutingBias state: {"layers": {i: {"ffn": {"bias": s}}}}.
    """
    cfg = self.cfg
    if segment_ids is None:
      segment_ids = jnp.ones(tokens.shape, jnp.int32)
    valid = segment_ids > 0
    x = self.embed_inputs(tokens, images, image_grid, image_index)
    stream = (BlockStream.start(x, num_blocks(cfg.num_layers, cfg.attnres.block_size) + 1)
              if cfg.attnres.enabled else x)
    moe_stats = {}   # layer index -> stats, at the position of that layer's ffn.bias
    call = DecoderLayer.__call__
    if self.remat != "none":
      call = nnx.remat(call, policy=REMAT_POLICIES[self.remat])
    for layer in self.layers:
      stream, stats = call(layer, stream, segment_ids, valid)
      if stats is not None:
        moe_stats[layer.index] = {"ffn": {"bias": stats}}
    h = self.final_mix(stream) if cfg.attnres.enabled else stream
    logits = self.lm_head(self.final_norm(h).astype(jnp.float32))
    return logits, {"moe": {"layers": moe_stats} if moe_stats else {}}
