"""The hybrid decoder: embedding -> [mixer, FFN] x L with Block AttnRes -> norm -> LM head.

Conventions: B batch, T tokens, d width, E routed experts. tokens/segment_ids [B, T] int32;
segment id 0 marks padding (excluded from routing statistics), and tokens of different
segments never interact (KDA state resets, attention masks, conv taps).

Vision (cfg.vision.enabled): per row up to M images padded to one S x S bucket,
images [B, M, S, S, C] float, image_grid [B, M, 2] int32 (real patch rows/cols, 0 = empty
slot) and image_index [B, T] int32 (-1 for text; else the flat index m * K + r * S/2p + c
of the merged image token that replaces this placeholder, K = (S/2p)^2). The tower runs on
every image slot and its outputs replace the placeholder embeddings (`embed_inputs`).

One forward serves training, prefill and decode: without a cache over whole (packed)
sequences; with a `DecodeCache` the T tokens continue each row at positions
cache.length[b] + i, segment_ids > 0 marking each row's real tokens (a prefix), so rows may
hold different lengths. The MoE routes with its current bias either way.

Routing replay (RL, DESIGN s9): routes {i: [B, T, k] int32} maps MoE layer indices to expert
ids per token. `record_routes=True` returns the experts every MoE layer ran in aux["routes"];
passing that dict back as `routes=` runs those experts instead of the router's choice,
weighted by the current router (`ops.routing.replay_route`); missing layers route freshly.
Works with and without a cache (each chunk replays its own slice), under jit and remat.

Scanned layers (compute.scan_layers, `model.stack`): the layers that repeat are stacked
parameters ("stack/<j>", leaves [R, ...]) run by one jax.lax.scan (remat inside its body;
a cached forward, or replay of only some repeats of a position, loops over their slices).
Everything comes out as without: logits, routes keyed by layer index, and aux["moe"]
shaped like the (then stacked) RoutingBias state, stacked stats [R, ...] under "stack".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, ModelConfig, is_int
from hybridmoe_jax.layers.attnres import BlockStream, DepthMix, num_blocks
from hybridmoe_jax.layers.embed import embed_lookup
from hybridmoe_jax.layers.kda import KDALayer
from hybridmoe_jax.layers.lm_head import LMHead
from hybridmoe_jax.layers.mla import MLALayer
from hybridmoe_jax.layers.moe import GLUMLP, MoE
from hybridmoe_jax.layers.norms import RMSNorm
from hybridmoe_jax.layers.vision import VisionTower
from hybridmoe_jax.model.cache import DecodeCache
from hybridmoe_jax.model.stack import STACK, LayerSplit, layer_split, stack_state
from hybridmoe_jax.ops.plan import current_plan

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderLayer(nnx.Module):
  """Pre-norm mixer (KDA or MLA) then pre-norm FFN (dense or MoE), each fed by AttnRes."""

  def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs,
               compute: ComputeConfig = ComputeConfig()):
    d, eps, dtype = cfg.d_model, cfg.norm_eps, compute.dtype
    self.index = index
    self.kind = cfg.layer_kinds[index]
    self.block = index // cfg.attnres.block_size + 1
    self.mixer_norm = RMSNorm(d, eps=eps)
    mixer_cls, mixer_cfg = (KDALayer, cfg.kda) if self.kind == "kda" else (MLALayer, cfg.mla)
    self.mixer = mixer_cls(d, mixer_cfg, norm_eps=eps, compute=compute, rngs=rngs)
    self.ffn_norm = RMSNorm(d, eps=eps)
    self.is_moe = cfg.is_moe_layer(index)
    if self.is_moe:
      self.ffn = MoE(d, cfg.moe, norm_eps=eps, compute=compute, rngs=rngs)
    else:
      self.ffn = GLUMLP(d, cfg.moe.dense_intermediate, glu=cfg.moe.glu, dtype=dtype, rngs=rngs)
    self.attnres = cfg.attnres.enabled
    if self.attnres:
      self.mixer_mix = DepthMix(d, eps=eps)
      self.ffn_mix = DepthMix(d, eps=eps)

  def __call__(self, stream, segment_ids: jax.Array, valid: jax.Array,
               replay: jax.Array | None = None, cache=None, length: jax.Array | None = None,
               kv_block: int = 512, block: jax.Array | int | None = None):
    """One decoder layer.

    Args:
      stream: BlockStream (AttnRes) or the residual x [B, T, d].
      segment_ids: [B, T] int32 (see HybridLM.__call__ for their meaning with a cache).
      valid: [B, T] bool, the real tokens (routing statistics count only these).
      replay: [B, T, k] int32 experts to run instead of the router's choice (MoE layers
        only; see `MoE.__call__`), or None.
      cache: this layer's KDACache / MLACache, or None (training).
      length: [B] int32 tokens already cached per row (with a cache).
      kv_block: keys per block of the cached MLA attention.
      block: the AttnRes slot this layer adds to (1-based), None: its own. A layer of the
        scanned stack is one module for every repeat: its slot is int32 [] traced from the
        scan counter.
    Returns:
      (stream, moe stats or None for a dense FFN, the experts run [B, T, k] int32 or None
      for a dense FFN, the layer's new cache or None).
    """
    block = self.block if block is None else block
    # A static slot (unrolled stack): the sources after it are still empty, read none of them.
    slots = block + 1 if isinstance(block, int) else None
    h = self.mixer_mix(stream, slots) if self.attnres else stream
    h = self.mixer_norm(h)
    if cache is not None and self.kind == "mla":
      out, cache = self.mixer(h, segment_ids=segment_ids, cache=cache, length=length,
                              kv_block=kv_block)
    else:
      out, cache = self.mixer(h, segment_ids=segment_ids, cache=cache)
    stream = stream.add(block, out) if self.attnres else stream + out
    h = self.ffn_mix(stream, slots) if self.attnres else stream
    if self.is_moe:
      out, stats, experts = self.ffn(self.ffn_norm(h), mask=valid, replay=replay)
    else:
      if replay is not None:
        raise ValueError(f"routes has an entry for layer {self.index}, a dense FFN layer")
      out, stats, experts = self.ffn(self.ffn_norm(h)), None, None
    stream = stream.add(block, out) if self.attnres else stream + out
    return stream, stats, experts, cache


class HybridLM(nnx.Module):
  """Decoder-only hybrid KDA/MLA sparse-MoE language model."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
               compute: ComputeConfig = ComputeConfig()):
    """One graph for every placement: where its ops run (context-parallel mixers, expert-
    parallel MoE) is the execution plan of the trace (`ops.plan`). Under a zigzag context
    layout the training forward moves its per-token inputs into the layout and its last
    hidden state back, so inputs and outputs stay in sequence order."""
    self.cfg = cfg
    self.compute = compute
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.dtype(compute.dtype),
                           param_dtype=jnp.float32,
                           embedding_init=nnx.initializers.normal(stddev=1.0), rngs=rngs)
    # With compute.scan_layers the layers that repeat (`model.stack.layer_split`) live in
    # `stack` (one module per position of the period, leaves [R, ...]) and `layers` keeps
    # None in their places, so every unscanned layer keeps its path "layers/<i>".
    split = layer_split(cfg) if compute.scan_layers else None
    scanned = split.scanned if split is not None else range(0)
    self.layers = nnx.List([None if i in scanned else
                            DecoderLayer(cfg, i, compute=compute, rngs=rngs)
                            for i in range(cfg.num_layers)])
    if scanned:
      self.stack = nnx.List([_stacked_layer(cfg, split.index(0, j), split.repeats, compute,
                                            rngs) for j in range(split.period)])
    if cfg.vision.enabled:
      self.vision = VisionTower(cfg.vision, cfg.d_model, eps=cfg.norm_eps, dtype=compute.dtype,
                                rngs=rngs)
    if cfg.attnres.enabled:
      self.final_mix = DepthMix(cfg.d_model, eps=cfg.norm_eps)
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    # The head runs in fp32 so logits (and the loss) are fp32 whatever the compute dtype.
    self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, rngs=rngs)

  def image_features(self, images: jax.Array, image_grid: jax.Array) -> jax.Array:
    """images [B, M, S, S, C], image_grid [B, M, 2] -> [B, M*K, d] projected image tokens."""
    b, m, s, _, c = images.shape
    feats = self.vision(images.reshape(b * m, s, s, c), image_grid.reshape(b * m, 2))
    return feats.reshape(b, m * feats.shape[1], feats.shape[2])

  def embed_inputs(self, tokens: jax.Array, images: jax.Array | None = None,
                   image_grid: jax.Array | None = None,
                   image_index: jax.Array | None = None, *, serving: bool = False
                   ) -> jax.Array:
    """tokens [B, T] -> input embeddings [B, T, d]; placeholders (image_index >= 0) take the
    projected image token they index (see the module docstring). `serving`: the weights
    are laid out for serving (`parallel.rules.tree_shardings(serving=True)`)."""
    x = embed_lookup(self.embed.embedding[...], tokens, self.embed.dtype, serving=serving)
    if images is None:
      return x
    if not self.cfg.vision.enabled:
      raise ValueError("images were given to a model without a vision tower "
                       "(model.vision.enabled = False)")
    feats = self.image_features(images, image_grid)
    picked = jnp.take_along_axis(feats, jnp.maximum(image_index, 0)[..., None], axis=1)
    return jnp.where(image_index[..., None] >= 0, picked.astype(x.dtype), x)

  def __call__(self, tokens: jax.Array | None, *, segment_ids: jax.Array | None = None,
               cache: DecodeCache | None = None, images: jax.Array | None = None,
               image_grid: jax.Array | None = None, image_index: jax.Array | None = None,
               inputs_embeds: jax.Array | None = None, logits_at: jax.Array | None = None,
               kv_block: int = 512, routes: Mapping[int, jax.Array] | None = None,
               record_routes: bool = False, return_hidden: bool = False
               ) -> tuple[jax.Array, dict[str, Any]]:
    """tokens [B, T] int32 (+ optional images, see the module docstring) -> (logits, aux).

    Args:
      tokens: [B, T] int32, or None when inputs_embeds is given.
      segment_ids: [B, T] int32 or None (all one document). Without a cache: packed
        document ids, 0 = padding. With a cache: > 0 real tokens, 0 padding (a suffix).
      cache: a DecodeCache to continue (see the module docstring), or None.
      images, image_grid, image_index: the image inputs (vision models).
      inputs_embeds: [B, T, d] precomputed input embeddings (e.g. a prompt with images
        embedded once and fed in chunks) instead of tokens and images.
      logits_at: [B, K] int32 positions of the chunk whose logits to compute (e.g. each
        row's last real token); None: every position.
      kv_block: keys per block of the cached MLA attention.
      routes: routing replay, {MoE layer index (int): [B, T, k] int expert ids} (see the
        module docstring and `check_routes`); layers left out route freshly. The balancing
        statistics in aux["moe"] still describe each router's own top-k.
      record_routes: also return the experts every MoE layer ran, in aux["routes"].
      return_hidden: return the last hidden state [B, T or K, d] fp32 (after the final
        norm: what `lm_head` reads) instead of the logits (the train loss applies the head
        block by block, `ops.cross_entropy`).
    Returns:
      logits [B, T or K, vocab] fp32 (or the hidden state, see return_hidden) and aux: aux["moe"] the routing statistics of every MoE
      layer (`layers.balancing.routing_stats`), shaped like the pure dict of the RoutingBias
      state: {"layers": {i: {"ffn": {"bias": s}}}}; aux["cache"] the updated DecodeCache
      (None without one); with record_routes, aux["routes"] = {i: [B, T, k] int32} for
      every MoE layer i (the dense layers have none): the replayed ids where given, else
      the router's top-k, best first.
    Raises:
      ValueError: bad `routes` (see `check_routes`), before any compute.
    """
    cfg = self.cfg
    lead = tokens if tokens is not None else inputs_embeds
    if routes is not None:
      check_routes(cfg, routes, None if lead is None else tuple(lead.shape[:2]))
    if inputs_embeds is not None:
      if tokens is not None or images is not None:
        raise ValueError("give either inputs_embeds or tokens (+ images), not both")
    elif tokens is None:
      raise ValueError("HybridLM needs tokens [B, T] or inputs_embeds [B, T, d]")
    if segment_ids is None:
      segment_ids = jnp.ones(lead.shape[:2], jnp.int32)
    if segment_ids.shape != lead.shape[:2]:
      raise ValueError(f"segment_ids has shape {segment_ids.shape}, the inputs "
                       f"{tuple(lead.shape[:2])}")
    # Context-parallel training forward: per-token arrays in the shards' layout (an identity
    # unless zigzag); the mixers know the layout, token-wise layers need not.
    layout = current_plan().context if cache is None else None
    if layout is not None:
      tokens, segment_ids, image_index, inputs_embeds = (
          None if a is None else layout.to_layout(a)
          for a in (tokens, segment_ids, image_index, inputs_embeds))
      if routes is not None:
        routes = {i: layout.to_layout(jnp.asarray(r)) for i, r in routes.items()}
    if inputs_embeds is not None:
      x = inputs_embeds.astype(self.compute.dtype)
    else:
      x = self.embed_inputs(tokens, images, image_grid, image_index,
                            serving=cache is not None)
    if cache is not None and len(cache.layers) != cfg.num_layers:
      raise ValueError(f"the cache holds {len(cache.layers)} layers, the model "
                       f"{cfg.num_layers}")
    valid = segment_ids > 0
    stream = (BlockStream.start(x, num_blocks(cfg.num_layers, cfg.attnres.block_size) + 1)
              if cfg.attnres.enabled else x)
    # moe_stats: layer index -> stats, at the position of that layer's ffn.bias.
    moe_stats, new_caches, recorded = {}, {}, {}
    call = DecoderLayer.__call__
    # Only training needs remat (it saves backward memory; a cached forward has no backward).
    if self.compute.remat != "none" and cache is None:
      call = nnx.remat(call, policy=REMAT_POLICIES[self.compute.remat])

    def run(layer, index, stream, block=None):
      """Layer `index` (original numbering) on the stream; records its stats and cache."""
      replay = None if routes is None else routes.get(index)
      if replay is not None:
        replay = jnp.asarray(replay, jnp.int32)
      if cache is None:
        slot = () if block is None else (None, None, kv_block, block)
        stream, stats, experts, _ = call(layer, stream, segment_ids, valid, replay, *slot)
      else:
        stream, stats, experts, new_caches[index] = layer(
            stream, segment_ids, valid, replay, cache.layers[index], cache.length, kv_block,
            block)
      if stats is not None:
        moe_stats[index] = {"ffn": {"bias": stats}}
        recorded[index] = experts
      return stream

    stacked_stats = None
    split = layer_split(cfg) if getattr(self, STACK, None) is not None else None
    for i, layer in enumerate(self.layers):
      if split is not None and i == split.start:
        stream, stacked_stats = self._run_stack(split, stream, routes, run, call,
                                                (segment_ids, valid), recorded,
                                                loop=cache is not None)
      if layer is not None:
        stream = run(layer, i, stream)
    h = self.final_norm(self.final_mix(stream) if cfg.attnres.enabled else stream)
    if layout is not None:
      h = layout.from_layout(h)
      recorded = {i: layout.from_layout(e) for i, e in recorded.items()}
    if logits_at is not None:
      if logits_at.ndim != 2 or logits_at.shape[0] != h.shape[0]:
        raise ValueError(f"logits_at must be [B={h.shape[0]}, K] positions, got shape "
                         f"{logits_at.shape}")
      h = jnp.take_along_axis(h, logits_at[..., None].astype(jnp.int32), axis=1)
    logits = h.astype(jnp.float32) if return_hidden else self.lm_head(h.astype(jnp.float32))
    new_cache = None
    if cache is not None:
      new_cache = DecodeCache(tuple(new_caches[i] for i in range(cfg.num_layers)),
                              cache.length + jnp.sum(valid, axis=1, dtype=jnp.int32))
    # Shaped like the RoutingBias state: a stacked bias [R, E] meets stats [R, ...].
    stats = {"layers": moe_stats} if moe_stats else {}
    if stacked_stats is not None:
      stats[STACK] = stacked_stats
    elif split is not None:   # the stack ran as a loop: per-layer stats, stacked here
      stats = stack_state(stats, cfg)
    aux = {"moe": stats, "cache": new_cache}
    if record_routes:
      aux["routes"] = dict(sorted(recorded.items()))
    return logits, aux

  def _run_stack(self, split: LayerSplit, stream, routes, run, call, masks, recorded, *,
                 loop: bool):
    """The scanned layers `split.scanned` on the stream: one `jax.lax.scan` over the R
    repeats (the stream its carry, the stacked parameters and replayed routes its xs), or,
    with a cache or routes given for only some repeats of a position, a Python loop over the
    repeats' slices (through `run`, like unscanned layers).

    Returns (stream, the stacked stats {j: {"ffn": {"bias": stats [R, ...]}}}, or None when
    the loop ran: then `run` recorded per-layer stats that the caller stacks).
    """
    graphdef, state = nnx.split(self.stack)
    bs, period = self.cfg.attnres.block_size, split.period
    replays = [_stacked_routes(routes, [split.index(r, j) for r in range(split.repeats)])
               for j in range(period)]
    if loop or any(r is _PARTIAL for r in replays):
      for r in range(split.repeats):
        layers = nnx.merge(graphdef, jax.tree.map(lambda a, r=r: a[r], state))
        for j, layer in enumerate(layers):
          i = split.index(r, j)
          stream = run(layer, i, stream, i // bs + 1)
      return stream, None
    segment_ids, valid = masks

    def body(stream, xs):
      r, state, replays = xs
      stats, experts = [], []
      for j, layer in enumerate(nnx.merge(graphdef, state)):
        # The AttnRes slot of layer index(r, j), from the traced repeat counter.
        block = split.index(r, j) // bs + 1
        stream, s, e, _ = call(layer, stream, segment_ids, valid, replays[j], None, None, 512,
                               block)
        stats.append(s)
        experts.append(e)
      return stream, (tuple(stats), tuple(experts))

    xs = (jnp.arange(split.repeats, dtype=jnp.int32), state, tuple(replays))
    stream, (stats, experts) = jax.lax.scan(body, stream, xs,
                                            unroll=self.compute.scan_unroll)
    for j in range(period):
      for r in range(split.repeats):
        recorded[split.index(r, j)] = experts[j][r]
    return stream, {j: {"ffn": {"bias": stats[j]}} for j in range(period)}


_PARTIAL = object()   # routes given for some repeats of a stacked position, not all


def _stacked_routes(routes: Mapping[int, Any] | None, indices: list[int]):
  """The replayed routes of one stacked position as scan xs: [R, B, T, k] int32 when
  `routes` has every layer of `indices`, None when it has none, else _PARTIAL."""
  have = [routes is not None and i in routes for i in indices]
  if not any(have):
    return None
  if not all(have):
    return _PARTIAL
  return jnp.stack([jnp.asarray(routes[i], jnp.int32) for i in indices])


def _stacked_layer(cfg: ModelConfig, index: int, repeats: int, compute: ComputeConfig,
                   rngs: nnx.Rngs) -> DecoderLayer:
  """`repeats` independently initialised copies of layer `index` as one module whose
  leaves are stacked [repeats, ...] (vmapped init: one trace for any depth)."""
  keys = jax.random.split(rngs.params(), repeats)
  make = nnx.vmap(lambda key: DecoderLayer(cfg, index, compute=compute, rngs=nnx.Rngs(key)),
                  in_axes=0, out_axes=0)
  return make(keys)


def check_routes(cfg: ModelConfig, routes: Mapping[int, Any],
                 batch_shape: tuple[int, int] | None) -> None:
  """Check a routing-replay dict before any compute; raises ValueError naming `routes`.

  Shapes and dtypes are always checked (they are static under jit too). The expert ids are
  checked only when they are concrete (numpy arrays, or jax arrays outside any trace: an
  eager call, or a learner checking its stored routes before the jitted step): inside jit
  they are tracers, and an id out of range there would gather a clamped or filled score
  instead of raising, so check host-side routes with this function before jitting.

  Args:
    cfg: the model config (MoE layer indices, E, k).
    routes: {MoE layer index (int): [B, T, k] int expert ids, each in [0, E), distinct per
      token}.
    batch_shape: (B, T) of the forward's inputs, or None to skip the batch check.

  Raises:
    ValueError: not a mapping; a key that is not a MoE layer index; a value that is not an
      integer [B, T, k] array; an expert id outside [0, E) or repeated within a token.
  """
  if not isinstance(routes, Mapping):
    raise ValueError(f"routes must be a dict {{MoE layer index: [B, T, k] int32}}, got "
                     f"{type(routes).__name__}")
  k, num_experts = cfg.moe.experts_per_token, cfg.moe.num_experts
  for key, ids in routes.items():
    if not is_int(key) or key not in cfg.moe_layers:
      raise ValueError(f"routes has key {key!r}: allowed the MoE layer indices "
                       f"{list(cfg.moe_layers)}")
    shape, dtype = tuple(getattr(ids, "shape", ())), getattr(ids, "dtype", None)
    want = (*batch_shape, k) if batch_shape is not None else None
    if (len(shape) != 3 or shape[-1] != k or (want is not None and shape != want)
        or dtype is None or not np.issubdtype(dtype, np.integer)):
      raise ValueError(f"routes[{key}] must be integer expert ids of shape "
                       f"{want or ('B', 'T', k)}, got {dtype} {shape}")
    if isinstance(ids, jax.core.Tracer) or (isinstance(ids, jax.Array)
                                            and not ids.is_fully_addressable):
      continue   # traced (under jit) or spread over hosts: values not readable here
    values = np.asarray(ids)
    if values.size and (values.min() < 0 or values.max() >= num_experts):
      raise ValueError(f"routes[{key}] has expert ids in [{values.min()}, {values.max()}]: "
                       f"allowed [0, {num_experts - 1}]")
    ordered = np.sort(values, axis=-1)
    if np.any(ordered[..., 1:] == ordered[..., :-1]):
      raise ValueError(f"routes[{key}] repeats an expert within a token: each token's k={k} "
                       "ids must be distinct")
