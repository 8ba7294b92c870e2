"""Which implementation each layer of a model resolves to, and why: one report at startup.

`kda(impl="auto")` picks the Pallas kernel or the chunked XLA path by backend and input
domain (`ops.kda.resolve_impl`); a run's log should say which one it got instead of leaving
a silent fallback to be discovered in a profile.
"""

from __future__ import annotations

from hybridmoe_jax.config import ComputeConfig, ModelConfig
from hybridmoe_jax.ops.kda import resolve_impl


def _layer_list(indices: list[int]) -> str:
  return ("layer " if len(indices) == 1 else "layers ") + ",".join(map(str, indices))


def describe_impls(cfg: ModelConfig, compute: ComputeConfig, *, moe_dispatch=None,
                   backend: str | None = None) -> list[str]:
  """One line per layer kind: the implementation it runs on `backend` and the reason.

  Args:
    cfg: the architecture; compute: the runtime knobs (kda_impl, kda_chunk_size, moe_impl).
    moe_dispatch: the MoE dispatch the model was built with (None: local experts).
    backend: a jax backend name; default `jax.default_backend()`.
  """
  kinds = cfg.layer_kinds
  lines = []
  kda_layers = [i for i, k in enumerate(kinds) if k == "kda"]
  if kda_layers:
    k = cfg.kda
    name, why = resolve_impl(compute.kda_impl, head_dim=k.head_dim, v_head_dim=k.v_head_dim,
                             chunk_size=compute.kda_chunk_size,
                             lower_bound=k.lower_bound if k.gate == "bounded" else None,
                             backend=backend)
    lines.append(f"{_layer_list(kda_layers)} (kda): {name} (chunk {compute.kda_chunk_size}; "
                 f"compute.kda_impl={compute.kda_impl!r}: {why}); one-token decode: recurrent")
  mla_layers = [i for i, k in enumerate(kinds) if k == "mla"]
  if mla_layers:
    rule = {"auto": f"dense [T, T] scores up to T = {4 * compute.mla_block}, blockwise "
                    f"(block {compute.mla_block}, O(T x block) memory) beyond",
            "dense": "dense [T, T] scores at every T",
            "blockwise": f"blockwise at every T (block {compute.mla_block})"}
    lines.append(f"{_layer_list(mla_layers)} (mla): expanded attention in XLA, "
                 f"compute.mla_impl={compute.mla_impl!r}: {rule[compute.mla_impl]}; cached "
                 "decode: absorbed latent attention, blockwise online softmax")
  moe_layers = list(cfg.moe_layers)
  if moe_layers:
    where = (f"local {compute.moe_impl!r} experts (compute.moe_impl)" if moe_dispatch is None
             else f"{type(moe_dispatch).__name__}"
             f"({', '.join(f'{n}={v}' for n, v in _dispatch_fields(moe_dispatch))})")
    lines.append(f"{_layer_list(moe_layers)} (moe): {where}")
  return lines


def _dispatch_fields(dispatch) -> list[tuple[str, object]]:
  """A dispatch's describable settings: mesh shape and its scalar fields."""
  out = []
  mesh = getattr(dispatch, "mesh", None)
  if mesh is not None:
    out.append(("mesh", dict(mesh.shape)))
  for name in ("capacity_factor", "exchange"):
    if hasattr(dispatch, name):
      out.append((name, getattr(dispatch, name)))
  return out
