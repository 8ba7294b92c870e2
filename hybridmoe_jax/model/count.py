"""Parameter counting from abstract shapes (jax.eval_shape: nothing is allocated).

Published convention (DESIGN s0): total = every weight; active = every weight one text token
uses except the input embedding (the LM head counts), i.e. all dense weights plus k/E of the
routed experts. The vision tower (DESIGN s5) is counted apart: `count_params` and
`param_breakdown` describe the text model only, `vision_breakdown` the tower.
The counts depend on the architecture only: `compute.scan_layers` changes the layout of the
layers (`model.stack`), not their parameters (tests/model/test_scan_layers.py counts a
model's own state in either layout against `param_breakdown`).
"""

import collections
import dataclasses
import math

from flax import nnx

from hybridmoe_jax.config import ComputeConfig, ModelConfig
from hybridmoe_jax.layers.vision import VisionTower
from hybridmoe_jax.model.decoder import DecoderLayer, HybridLM
from hybridmoe_jax.model.stack import LAYERS, STACK, layer_split

COMPONENTS = ("kda", "mla", "routed_experts", "shared_experts", "router_latent", "dense_ffn",
              "attnres_norms", "embedding", "lm_head")


def _component(cfg: ModelConfig, path: tuple, shape: tuple) -> str:
  """The COMPONENTS entry of the leaf at `path` of shape `shape` (a path and shape of
  either layout: "stack/<j>/..." [R, ...] is read as its layer "layers/<index(0, j)>/...")."""
  keys = [str(p) for p in path]
  if keys[0] == STACK:
    keys = [LAYERS, str(layer_split(cfg).index(0, int(keys[1])))] + keys[2:]
    shape = shape[1:]
  if keys[0] == "embed":
    return "embedding"
  if keys[0] == "lm_head":
    return "lm_head"
  if keys[0] != "layers" or len(keys) < 3:
    return "attnres_norms"
  layer, part = int(keys[1]), keys[2]
  if part == "mixer":
    return cfg.layer_kinds[layer]
  if part != "ffn":
    return "attnres_norms"
  if not cfg.is_moe_layer(layer):
    return "dense_ffn"
  if len(shape) == 3 and shape[0] == cfg.moe.num_experts:
    return "routed_experts"
  if "shared" in keys:
    return "shared_experts"
  return "router_latent"


def param_pieces(cfg: ModelConfig, vision: bool = False
                 ) -> list[tuple[int | None, nnx.State, int]]:
  """Abstract parameter states that tile the model, as (layer index, state, multiplicity):
  one decoder layer per distinct (mixer kind, dense or MoE) variant, then (None, everything
  outside the layer stack, 1) from a one-layer model of the same widths (with the vision
  tower only if `vision`). Tracing a 93-layer model in one eval_shape is quadratic in JAX's
  tracer bookkeeping (minutes); one layer per variant takes a second."""
  pieces = []
  for index, *rest in cfg.layer_variants().values():
    layer = nnx.eval_shape(lambda i=index: DecoderLayer(cfg, i, compute=ComputeConfig(),
                                                        rngs=nnx.Rngs(0)))
    pieces.append((index, nnx.state(layer, nnx.Param), 1 + len(rest)))
  one = dataclasses.replace(cfg, num_layers=1, layer_kinds=("kda",),
                            moe=dataclasses.replace(cfg.moe, first_dense_layers=1),
                            vision=dataclasses.replace(cfg.vision,
                                                       enabled=cfg.vision.enabled and vision))
  outer = nnx.state(nnx.eval_shape(lambda: HybridLM(one, rngs=nnx.Rngs(0))), nnx.Param)
  pieces.append((None, nnx.State({k: v for k, v in outer.items() if k != "layers"}), 1))
  return pieces


def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
  """Total parameters per component (keys: COMPONENTS), from abstract shapes only
  (`param_pieces`)."""
  counts = collections.Counter({c: 0 for c in COMPONENTS})
  for index, state, times in param_pieces(cfg):
    prefix = () if index is None else ("layers", str(index))
    for path, leaf in nnx.to_flat_state(state):
      shape = tuple(leaf.shape)
      counts[_component(cfg, prefix + tuple(str(p) for p in path), shape)] += (
          times * math.prod(shape))
  return dict(counts)


VISION_COMPONENTS = ("patch_embed", "position_table", "encoder_blocks", "projector")


def vision_breakdown(cfg: ModelConfig) -> dict[str, int]:
  """Vision-tower parameters per part (keys: VISION_COMPONENTS); all 0 without vision.

  One encoder block is traced and multiplied by the depth, as for the decoder layers.
  """
  counts = {c: 0 for c in VISION_COMPONENTS}
  v = cfg.vision
  if not v.enabled:
    return counts
  one = dataclasses.replace(v, num_layers=min(v.num_layers, 1))
  tower = nnx.eval_shape(lambda: VisionTower(one, cfg.d_model, eps=cfg.norm_eps,
                                             dtype=ComputeConfig().dtype, rngs=nnx.Rngs(0)))
  for path, leaf in nnx.to_flat_state(nnx.state(tower, nnx.Param)):
    n = math.prod(leaf.shape)
    part = str(path[0])
    if part == "blocks":
      counts["encoder_blocks"] += n * v.num_layers
    elif part == "patch_embed":
      counts["patch_embed"] += n
    elif part == "pos_table":
      counts["position_table"] += n
    else:  # merge norm, projector MLP and its final norm
      counts["projector"] += n
  return counts


def active_breakdown(cfg: ModelConfig, counts: dict[str, int]) -> dict[str, int]:
  """Each component's parameters active per token: none of the embedding (a lookup), the
  routed experts' top-k share (floored), all of the rest."""
  k, e = cfg.moe.experts_per_token, cfg.moe.num_experts
  return {name: 0 if name == "embedding" else n * k // e if name == "routed_experts" else n
          for name, n in counts.items()}


def active_from_breakdown(cfg: ModelConfig, counts: dict[str, int]) -> int:
  return sum(active_breakdown(cfg, counts).values())


def count_params(cfg: ModelConfig) -> tuple[int, int]:
  """(total, active) parameter counts of the text model under the published convention."""
  counts = param_breakdown(cfg)
  return sum(counts.values()), active_from_breakdown(cfg, counts)
