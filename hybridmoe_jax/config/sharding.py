"""Logical axis names -> mesh axes (MaxText style): the rules every layer's sharding
annotations and the state layout (`parallel.rules`) read.

`MESH_AXES` is the one list of mesh axis names. `LOGICAL_RULES` maps a logical name to a
mesh axis, a tuple of axes or None (replicated), first match wins. Layers annotate
activations with `constrain(x, names)`: a sharding hint under a multi-device mesh context,
the identity otherwise (it never changes what is computed). This module sits below `ops`
and `layers` (jax and numpy only), so layers can annotate without importing `parallel`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor", "context")
# Sequences of a training batch go over every axis that holds distinct data, as in
# MaxText's activation rules: data, fsdp and expert (only inside the MoE do the
# expert-parallel exchanges move tokens to their experts' shards). Without expert, the
# attention, KDA, shared experts, LM head and loss of the 48B step repeated the same tokens
# on all 8 expert shards. A batch whose rows do not divide over all three keeps the ones
# that do (`batch_axes`); every batch must split over DATA_AXES (`parallel.mesh.
# check_mesh_fits`), and serving rows (decode, prefill) are laid out over DATA_AXES.
BATCH_AXES = ("data", "fsdp", "expert")
DATA_AXES = ("data", "fsdp")
TOKEN_AXES = ("data", "fsdp", "expert")   # tokens inside the MoE dispatch

MeshAxes = str | tuple[str, ...] | None

LOGICAL_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # activations
    ("batch", BATCH_AXES),       # the axes of these that divide the rows (spec_for)
    ("tokens", ("data", "fsdp", "expert")),
    ("length", "context"),       # a sequence over context shards (parallel/context.py)
    ("act_embed", None),
    # parameters
    # The model width d of every weight, ZeRO-3 style, over fsdp, context and expert (as
    # MaxText's embed rule): the context and expert axes hold distinct tokens, so without
    # them the non-expert state would be replicated on their shards (K3 on v5p-2048 with
    # expert 64: 23.1 GiB of parameters per device instead of 10.4). Serving keeps these
    # weights whole over context and expert (`parallel.rules.tree_shardings`).
    ("embed", ("fsdp", "context", "expert")),
    ("vocab", "tensor"),
    ("mlp", "tensor"),           # dense / shared FFN hidden width
    ("heads", "tensor"),         # projected q/k/v/gate widths (heads x head_dim)
    ("latent", None),            # MLA kv latent, MoE latent width, low-rank factors
    # The rank dim an up-projection reads (q_b, k_up, v_up, f_b, gate up): like embed, or
    # the weight would be whole on every device (q_b of K3: 108 MiB per MLA layer, x 3 with
    # the moments).
    ("latent_in", ("fsdp", "context", "expert")),
    ("expert", "expert"),        # routed experts are owned by expert shards
    ("expert_embed", ("fsdp", "context")),
    ("expert_mlp", "tensor"),
    ("routing", None),           # router columns and balancing biases: every shard routes
    ("norm", None),
    ("conv", None),
    ("layers", None),            # the [R] repeats of a scanned layer stack (parallel.rules)
)

def batch_axes(mesh_shape, rows: int | None = None) -> tuple[str, ...]:
  """The axes of BATCH_AXES in `mesh_shape` ({axis: size}) that `rows` sequences split
  over, in order, each kept when the product so far still divides `rows` (as `spec_for`
  keeps them for the "batch" rule); rows None: all of them."""
  out, size = [], 1
  for a in BATCH_AXES:
    if a in mesh_shape and (rows is None or rows % (size * mesh_shape[a]) == 0):
      out.append(a)
      size *= mesh_shape[a]
  return tuple(out)


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


def spec_for(names: Sequence[str | None], shape: Sequence[int], mesh_shape: dict,
             owned_only: Sequence[str] = ()) -> P:
  """PartitionSpec from logical names, keeping only axes that divide the dim, each used once.

  `owned_only`: mesh axes that split only the dim whose logical name is the axis itself
  (serving passes ("expert",): routed experts stay on their shards, while the other weights,
  which training also splits over expert, are not gathered over it at every decode step)."""
  used, out = set(), []
  for name, size in zip(names, shape):
    axes = mesh_axes(name)
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    keep = []
    for ax in axes:
      if ax not in mesh_shape or ax in used or mesh_shape[ax] == 1:
        continue
      if ax in owned_only and name != ax:
        continue
      if size % int(np.prod([mesh_shape[a] for a in keep + [ax]])) == 0:
        keep.append(ax)
    used.update(keep)
    out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """`with_sharding_constraint` by logical names under the context mesh; identity otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, spec_for(names, x.shape, dict(mesh.shape)))
