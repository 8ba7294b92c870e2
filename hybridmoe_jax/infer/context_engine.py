"""Prefill and generation with the prompt sharded over the mesh axis `context`: prompts
longer than one device holds (`parallel.context_decode` for the layout and the math).

`ContextParallelEngine(model, mesh, max_len=N)` is an `Engine` whose steps are traced under
the execution plan of the `ContextDecode` runner (`ops.plan`; entered with the mesh, which
keys the jitted programs apart from a local engine's) and whose cache keeps every MLA layer's latents split
along N over `context` (N / n slots per device; KDA states and conv tails replicated). The
prompt is fed in ONE sharded chunk (padded on the right to a multiple of n, the padding
masked), into a fresh cache; decoding, `generate` and sampling are `Engine`'s own jitted
steps. Greedy generation equals the single-device `Engine` token for token. `score`
(teacher-forced nll of a long text) is the same sharded forward with every position's
logits.

Parameters are placed by the project's rules (`parallel.rules`: replicated on a mesh of
`context` alone, split over fsdp / tensor / expert where the mesh has them); rows split
over (data, fsdp). One compilation per padded prompt length and batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hybridmoe_jax.infer.engine import Engine
from hybridmoe_jax.infer.steps import _prefill_chunk, _score_chunk
from hybridmoe_jax.model.cache import DecodeCache, KDACache
from hybridmoe_jax.model.decoder import HybridLM
from hybridmoe_jax.parallel.context import CONTEXT_AXIS
from hybridmoe_jax.parallel.context_decode import ContextDecode, ShardedMLACache
from hybridmoe_jax.parallel.rules import tree_shardings
from hybridmoe_jax.config.sharding import DATA_AXES


class ContextParallelEngine(Engine):
  """`Engine` over a cache sharded along its length on `mesh`'s `context` axis.

  Args:
    model: a HybridLM.
    mesh: a mesh with a `context` axis (e.g. `parallel.mesh.build_mesh({"context": 4})`).
    max_len: cache capacity in tokens per row (prompt + generated), rounded up to a
      multiple of mesh.context; each device holds max_len / n of it.
    kv_block: keys per block of the MLA attention (prefill ring and decode).
  """

  def __init__(self, model: HybridLM, mesh: Mesh, *, max_len: int, kv_block: int = 512):
    if CONTEXT_AXIS not in mesh.shape:
      raise ValueError(f"mesh has no '{CONTEXT_AXIS}' axis: axes {tuple(mesh.shape)}")
    if not (isinstance(max_len, (int, np.integer)) and max_len >= 1):
      raise ValueError(f"max_len must be an integer >= 1, got {max_len!r}")
    self.mesh = mesh
    self.shards = mesh.shape[CONTEXT_AXIS]
    self.slots_per_shard = math.ceil(max_len / self.shards)
    # Mixers on the sharded cache; routing and local experts on each device's prompt tokens.
    self.placement = ContextDecode(mesh).placement
    super().__init__(model, max_len=self.slots_per_shard * self.shards,
                     prefill_chunk=self.slots_per_shard * self.shards, kv_block=kv_block)
    self.state = jax.device_put(self.state, tree_shardings(self.state, mesh, serving=True))

  def init_cache(self, batch: int) -> DecodeCache:
    """An empty cache: MLA latents sharded along N over `context`, the rest replicated."""
    rep = NamedSharding(self.mesh, P(DATA_AXES))
    layers = tuple(
        jax.device_put(KDACache.zeros(self.cfg.kda, batch, self.dtype), rep) if kind == "kda"
        else ShardedMLACache.zeros(self.cfg.mla, batch, self.slots_per_shard, self.mesh,
                                   self.dtype)
        for kind in self.cfg.layer_kinds)
    return DecodeCache(layers, jax.device_put(jnp.zeros((batch,), jnp.int32), rep))

  def prefill(self, tokens, cache: DecodeCache | None = None, images: dict | None = None,
              lengths=None) -> tuple[jax.Array, DecodeCache]:
    """A prompt [B, T] into a fresh sharded cache -> (last real token's logits [B, V], cache).

    lengths: optional [B] ints in [0, T], as `Engine.prefill`. T is padded on the right to a
    multiple of mesh.context (the padding is masked and never seen by a real token).
    Raises:
      ValueError: a cache was passed (a context-parallel prompt starts a fresh cache), bad
        tokens / lengths, or the prompt exceeds max_len.
      NotImplementedError: images (embed them and prefill on one device).
    """
    if cache is not None:
      raise ValueError("cache: ContextParallelEngine.prefill starts a fresh cache; continue "
                       "a cache with decode_step / generate")
    if images is not None:
      raise NotImplementedError("images: context-parallel prefill takes text prompts only")
    tokens, lengths = self._check_tokens(tokens, None, "prompt", lengths)
    b, t = tokens.shape
    pad = -t % self.shards
    n_valid = np.full((b,), t, np.int32) if lengths is None else lengths
    tokens = jax.device_put(np.pad(tokens, ((0, 0), (0, pad))),
                            NamedSharding(self.mesh, P(DATA_AXES, CONTEXT_AXIS)))
    n_valid = jax.device_put(n_valid, NamedSharding(self.mesh, P(DATA_AXES)))
    with self.placement():
      return _prefill_chunk(self.graphdef, self.state, tokens, None, self.init_cache(b),
                            n_valid, kv_block=self.kv_block)

  def decode_step(self, token, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
    """As `Engine.decode_step` (one token per row, replicated) on the sharded cache."""
    with self.placement():
      return super().decode_step(token, cache)

  def generate(self, prompt, **kwargs):
    """As `Engine.generate` (same arguments; no images)."""
    with self.placement():
      return super().generate(prompt, **kwargs)

  def score(self, tokens) -> tuple[np.ndarray, np.ndarray]:
    """As `Engine.score` (nll [B, T-1] of tokens[:, 1:], argmax predictions [B, T-1]), the
    text fed as one sharded chunk."""
    tokens, _ = self._check_tokens(tokens, None, "text")
    b, t = tokens.shape
    pad = ((0, 0), (0, -t % self.shards))
    targets = np.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    seq = NamedSharding(self.mesh, P(DATA_AXES, CONTEXT_AXIS))
    with self.placement():
      nll, pred, _ = _score_chunk(
          self.graphdef, self.state, jax.device_put(np.pad(tokens, pad), seq),
          jax.device_put(np.pad(targets, pad), seq), self.init_cache(b),
          jax.device_put(np.full((b,), t, np.int32), NamedSharding(self.mesh, P(DATA_AXES))),
          kv_block=self.kv_block)
    return np.asarray(nll)[:, :t - 1], np.asarray(pred)[:, :t - 1]
