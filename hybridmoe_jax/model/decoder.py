"""The hybrid decoder: embedding -> [mixer, FFN] x L with Block AttnRes -> norm -> LM head.

Conventions: B batch, T tokens, d width, E routed experts. tokens/segment_ids [B, T] int32;
segment id 0 marks padding (excluded from routing statistics), and tokens of different
segments never interact (KDA state resets, attention masks, conv taps).
"""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import ModelConfig
from hybridmoe_jax.layers.attnres import BlockStream, DepthMix, num_blocks
from hybridmoe_jax.layers.kda import KDALayer
from hybridmoe_jax.layers.linear import linear
from hybridmoe_jax.layers.mla import MLALayer
from hybridmoe_jax.layers.moe import GLUMLP, MoE
from hybridmoe_jax.layers.norms import RMSNorm

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderLayer(nnx.Module):
  """Pre-norm mixer (KDA or MLA) then pre-norm FFN (dense or MoE), each fed by AttnRes."""

  def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
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
      self.ffn = MoE(d, cfg.moe, norm_eps=eps, dtype=dtype, rngs=rngs)
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

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat: str = "none"):
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat={remat!r} is invalid: allowed one of {sorted(REMAT_POLICIES)}")
    self.cfg = cfg
    self.remat = remat
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.dtype(cfg.dtype),
                           param_dtype=jnp.float32,
                           embedding_init=nnx.initializers.normal(stddev=1.0), rngs=rngs)
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
    if cfg.attnres.enabled:
      self.final_mix = DepthMix(cfg.d_model, eps=cfg.norm_eps)
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    # The head runs in fp32 so logits (and the loss) are fp32 whatever the compute dtype.
    self.lm_head = linear(cfg.d_model, cfg.vocab_size, dtype="float32", rngs=rngs)

  def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None
               ) -> tuple[jax.Array, dict[str, Any]]:
    """tokens [B, T] int32 -> (logits [B, T, vocab] fp32, aux).

    aux["moe"][f"layer_{i}"] holds additive int32 routing statistics of MoE layer i:
    "load" [E] and, with Quantile Balancing, "qb_hist" [E, qb_num_bins].
    """
    cfg = self.cfg
    if segment_ids is None:
      segment_ids = jnp.ones(tokens.shape, jnp.int32)
    valid = segment_ids > 0
    x = self.embed(tokens)
    stream = (BlockStream.start(x, num_blocks(cfg.num_layers, cfg.attnres.block_size) + 1)
              if cfg.attnres.enabled else x)
    moe_stats = {}
    call = DecoderLayer.__call__
    if self.remat != "none":
      call = nnx.remat(call, policy=REMAT_POLICIES[self.remat])
    for layer in self.layers:
      stream, stats = call(layer, stream, segment_ids, valid)
      if stats is not None:
        moe_stats[f"layer_{layer.index}"] = stats
    h = self.final_mix(stream) if cfg.attnres.enabled else stream
    logits = self.lm_head(self.final_norm(h).astype(jnp.float32))
    return logits, {"moe": moe_stats}
