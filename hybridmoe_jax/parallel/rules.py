"""The one table of sharding rules: logical axis names -> mesh axes (MaxText style).

Two tables, both read top to bottom, first match wins:
  LOGICAL_RULES   logical name -> mesh axis / tuple of axes / None (replicated);
  PARAM_LOGICAL   regex on a leaf's path ("layers/1/ffn/w_gate") -> one logical name per dim.
Parameters, their optimizer moments (whose paths end with the parameter's path) and the
routing biases all go through `PARAM_LOGICAL`, so a moment is always sharded like its
parameter. A dimension whose size the mesh axes do not divide, or a leaf whose rank does not
match its pattern, stays replicated in that dimension (e.g. the 259-row byte embedding over
tensor=2), and a mesh axis is used at most once per array.
Activations use `constrain(x, names)` (a no-op outside a mesh context).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None

LOGICAL_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("tokens", ("data", "fsdp", "expert")),
    ("length", None),
    ("act_embed", None),
    # parameters
    ("embed", "fsdp"),           # the model width d of every weight: ZeRO-3 style
    ("vocab", "tensor"),
    ("mlp", "tensor"),           # dense / shared FFN hidden width
    ("heads", "tensor"),         # projected q/k/v/gate widths (heads x head_dim)
    ("latent", None),            # MLA kv latent, MoE latent width, low-rank factors
    ("expert", "expert"),        # routed experts are owned by expert shards
    ("expert_embed", "fsdp"),
    ("expert_mlp", "tensor"),
    ("routing", None),           # router columns and balancing biases: every shard routes
    ("norm", None),
    ("conv", None),
)

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
    (_M + r"mixer/(b_proj|f_a)/kernel$", ("embed", "latent")),
    (_M + r"mixer/f_b/kernel$", ("latent", "heads")),
    (_M + r"mixer/(k_up|v_up)/kernel$", ("latent", "heads")),
    (_M + r"mixer/o_proj/kernel$", ("heads", "embed")),
    (_M + r"conv/weight$", ("conv", "heads")),
)
_COMPILED = tuple((re.compile(p), names) for p, names in PARAM_LOGICAL)


def mesh_axes(name: str | None) -> MeshAxes:
  """Mesh axes of one logical name (KeyError for a name missing from LOGICAL_RULES)."""
  if name is None:
    return None
  for key, axes in LOGICAL_RULES:
    if key == name:
      return axes
  raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_RULES")


def path_string(path: Sequence[Any]) -> str:
  """A jax key path as "a/b/0/c", dropping the trailing Variable `value` attribute."""
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  if parts and parts[-1] in ("value", "raw_value"):
    parts.pop()
  return "/".join(parts)


def logical_names(path: str, ndim: int) -> tuple[str | None, ...]:
  """Logical names of a leaf's dims (all None when no pattern matches or the rank differs)."""
  for pattern, names in _COMPILED:
    if pattern.search(path):
      return names if len(names) == ndim else (None,) * ndim
  return (None,) * ndim


def spec_for(names: Sequence[str | None], shape: Sequence[int], mesh_shape: dict) -> P:
  """PartitionSpec from logical names, keeping only axes that divide the dim, each used once."""
  used, out = set(), []
  for name, size in zip(names, shape):
    axes = mesh_axes(name)
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    keep = []
    for ax in axes:
      if ax not in mesh_shape or ax in used or mesh_shape[ax] == 1:
        continue
      if size % int(np.prod([mesh_shape[a] for a in keep + [ax]])) == 0:
        keep.append(ax)
    used.update(keep)
    out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def tree_shardings(tree, mesh: Mesh):
  """NamedSharding for every array leaf of `tree` (params, optimizer state, biases, ...)."""
  shape = dict(mesh.shape)

  def one(path, leaf):
    dims = tuple(getattr(leaf, "shape", ()))
    names = logical_names(path_string(path), len(dims))
    return NamedSharding(mesh, spec_for(names, dims, shape))

  return jax.tree_util.tree_map_with_path(one, tree)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names under the context mesh; identity otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, spec_for(names, x.shape, dict(mesh.shape)))
