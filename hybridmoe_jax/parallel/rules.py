"""The one table of sharding rules: logical axis names -> mesh axes (MaxText style).

Three tables, read top to bottom, first match wins:
  LOGICAL_RULES   logical name -> mesh axis / tuple of axes / None (replicated);
  PARAM_LOGICAL   regex on a leaf's path ("layers/1/ffn/w_gate") -> one logical name per dim;
  REPLICATED      regexes of parameters kept whole on purpose (norm scales, decays).
Every parameter of every preset is in exactly one of the last two (tests/parallel/
test_rules.py); a leaf in neither is replicated with a log line, never silently.
Parameters, their optimizer moments (whose paths end with the parameter's path) and the
routing biases all go through `PARAM_LOGICAL`, so a moment is always sharded like its
parameter. A dimension whose size the mesh axes do not divide, or a leaf whose rank does not
match its pattern, stays replicated in that dimension (e.g. the 259-row byte embedding over
tensor=2), and a mesh axis is used at most once per array.
`LOGICAL_RULES`, `spec_for` and the activation hint `constrain` live in
`hybridmoe_jax.config.sharding` (below the layers, which annotate with them).
"""

from __future__ import annotations

import re

from absl import logging
import jax
from jax.sharding import Mesh, NamedSharding

from hybridmoe_jax.config.sharding import path_string, spec_for
from hybridmoe_jax.model.stack import stacked_position

_M = r"(^|/)"
PARAM_LOGICAL: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (_M + r"embed/embedding$", ("vocab", "embed")),
    (_M + r"lm_head/kernel$", ("embed", "vocab")),
    (_M + r"ffn/(w_gate|w_up)$", ("expert", "expert_embed", "expert_mlp")),
    (_M + r"ffn/w_down$", ("expert", "expert_mlp", "expert_embed")),
    (_M + r"ffn/router$", ("embed", "routing")),
    (_M + r"ffn/bias$", ("routing",)),
    (_M + r"ffn/latent_down$", ("embed", "latent")),
    (_M + r"ffn/latent_up$", ("latent", "embed")),
    (_M + r"(gate|up)$", ("embed", "mlp")),                       # dense + shared GLU MLPs
    (_M + r"down$", ("mlp", "embed")),
    (_M + r"mixer/(q_proj|k_proj|v_proj|g_proj|k_rope|kv_a|gate)/kernel$", ("embed", "heads")),
    (_M + r"mixer/(b_proj|f_a|q_a)/kernel$", ("embed", "latent")),
    (_M + r"mixer/(f_b|q_b)/kernel$", ("latent_in", "heads")),
    (_M + r"mixer/g_proj/layers/0/kernel$", ("embed", "latent")),   # low-rank output gate
    (_M + r"mixer/g_proj/layers/1/kernel$", ("latent_in", "heads")),
    (_M + r"mixer/(k_up|v_up)/kernel$", ("latent_in", "heads")),
    (_M + r"mixer/o_proj/kernel$", ("heads", "embed")),
    (_M + r"mixer/(q|k|v)_conv/weight$", ("conv", "heads")),
    # The vision tower, ZeRO-3 like the text weights: whole on every device it cost K3
    # 5 GiB of parameters and moments per device (libtpu buffer assignment, BENCHMARKS.md).
    (_M + r"vision/blocks/\d+/(qkv|up)/kernel$", ("embed", "mlp")),
    (_M + r"vision/blocks/\d+/(out|down)/kernel$", ("mlp", "embed")),
    (_M + r"vision/(patch_embed|proj_in)/kernel$", (None, "embed")),
    (_M + r"vision/proj_out/kernel$", ("mlp", "embed")),
    (_M + r"vision/pos_table$", (None, None, "embed")),
)
# Parameters kept whole on every device, on purpose: each is O(d) or O(heads) (norm scales,
# decay parameters, AttnRes queries), so sharding them would add collectives and save
# nothing. A parameter in neither table is not placed silently: `logical_names` logs it
# (tests/parallel/test_rules.py requires every parameter of every preset to be in exactly
# one table).
REPLICATED: tuple[str, ...] = (
    r"(^|/)(\w+_)?norm/scale$", r"(^|/)mixer/o_norm_scale$",
    r"(^|/)mixer/(a_log|dt_bias)$", r"(^|/)\w*mix/query$",
)
# The leading dim of a scanned stack's leaves (LOGICAL_RULES: replicated, as in MaxText).
STACKED_DIM = "layers"
_COMPILED = tuple((re.compile(p), names) for p, names in PARAM_LOGICAL)
_REPLICATED = tuple(re.compile(p) for p in REPLICATED)
_UNRULED_LOGGED: set[str] = set()


def logical_names(path: str, ndim: int) -> tuple[str | None, ...]:
  """Logical names of a leaf's dims: its PARAM_LOGICAL names, or all None (replicated) for a
  REPLICATED parameter, a scalar, a rank mismatch or a leaf no rule names (logged once per
  path shape, since an unplaced large weight would silently cost memory on every device).
  A leaf of a scanned layer stack ("stack/<j>/...", `model.stack`) is its layer's leaf with
  a leading [R] dim: named STACKED_DIM, then the layer's names, so it is sharded like the
  unstacked layer (and replicated over the repeats)."""
  stacked = (STACKED_DIM,) if stacked_position(path) is not None else ()
  for pattern, names in _COMPILED:
    if pattern.search(path):
      names = stacked + names
      return names if len(names) == ndim else (None,) * ndim
  if ndim and not any(r.search(path) for r in _REPLICATED):
    key = re.sub(r"\d+", "N", path)
    if key not in _UNRULED_LOGGED:
      _UNRULED_LOGGED.add(key)
      logging.info("sharding: no rule names %s (rank %d): replicated", path, ndim)
  return (None,) * ndim


def tree_shardings(tree, mesh: Mesh, *, serving: bool = False):
  """NamedSharding for every array leaf of `tree` (params, optimizer state, biases, ...);
  `serving` replicates over context, and over expert except the routed experts' own dim (a
  decode step would all-gather every such weight per token)."""
  shape = dict(mesh.shape, **({"context": 1} if serving else {}))
  owned_only = ("expert",) if serving else ()

  def one(path, leaf):
    dims = tuple(getattr(leaf, "shape", ()))
    names = logical_names(path_string(path), len(dims))
    return NamedSharding(mesh, spec_for(names, dims, shape, owned_only))

  return jax.tree_util.tree_map_with_path(one, tree)
