"""Which implementation each layer of a model resolves to, and why: one report at startup.

`kda(impl="auto")` picks the Pallas kernel or the chunked XLA path by target platform and input
domain (`ops.kda.resolve_impl`), MLA's `compute.mla_impl` an XLA core or an accelerator
kernel (`ops.attention_backends.resolve_impl`); a run's log should say which one it got
instead of leaving a silent fallback to be discovered in a profile (`log_impls` warns).
"""

from __future__ import annotations

from absl import logging

from hybridmoe_jax.config import ComputeConfig, ModelConfig
from hybridmoe_jax.ops import attention_backends
from hybridmoe_jax.ops.kda import PALLAS_BACKENDS
from hybridmoe_jax.ops.kda import resolve_impl as kda_resolve


def _layer_list(indices: list[int]) -> str:
  return ("layer " if len(indices) == 1 else "layers ") + ",".join(map(str, indices))


def describe_impls(cfg: ModelConfig, compute: ComputeConfig, *, moe_dispatch=None,
                   backend: str | None = None) -> list[str]:
  """One line per layer kind: the implementation it runs on `backend` and the reason.

  Args:
    cfg: the architecture; compute: the runtime knobs (kda_impl, kda_chunk_size, mla_impl,
      mla_block, moe_impl).
    moe_dispatch: the MoE dispatch the model was built with (None: local experts).
    backend: a jax platform name; default the target platform (`ops.platform`: the active
      mesh's devices, else the host's backend; and a local GPU's compute capability).
  """
  return [line for line, _ in _report(cfg, compute, moe_dispatch, backend)]


def log_impls(cfg: ModelConfig, compute: ComputeConfig, *, moe_dispatch=None,
              backend: str | None = None) -> None:
  """Logs `describe_impls` (absl): a line whose accelerator kernel fell back to XLA as a
  warning, the others as info."""
  for line, fallback in _report(cfg, compute, moe_dispatch, backend):
    (logging.warning if fallback else logging.info)("implementation: %s", line)


def _report(cfg: ModelConfig, compute: ComputeConfig, moe_dispatch, backend: str | None
            ) -> list[tuple[str, bool]]:
  """(line, fell back from an accelerator kernel to XLA) per layer kind."""
  capability, given = None, backend
  if backend is None:  # the platform the program is compiled for (the mesh's devices)
    backend, capability = attention_backends.current_backend()
  kinds = cfg.layer_kinds
  lines = []
  kda_layers = [i for i, k in enumerate(kinds) if k == "kda"]
  if kda_layers:
    k = cfg.kda
    name, why = kda_resolve(compute.kda_impl, head_dim=k.head_dim, v_head_dim=k.v_head_dim,
                            chunk_size=compute.kda_chunk_size,
                            lower_bound=k.lower_bound if k.gate == "bounded" else None,
                            backend=given)
    fallback = compute.kda_impl == "auto" and backend in PALLAS_BACKENDS and name != "pallas"
    lines.append((f"{_layer_list(kda_layers)} (kda): {name} (chunk {compute.kda_chunk_size}; "
                  f"compute.kda_impl={compute.kda_impl!r}: {why}); one-token decode: "
                  "recurrent", fallback))
  mla_layers = [i for i, k in enumerate(kinds) if k == "mla"]
  if mla_layers:
    lines.append(_mla_line(cfg, compute, backend, capability, mla_layers))
  moe_layers = list(cfg.moe_layers)
  if moe_layers:
    where = (f"local {compute.moe_impl!r} experts (compute.moe_impl)" if moe_dispatch is None
             else f"{type(moe_dispatch).__name__}"
             f"({', '.join(f'{n}={v}' for n, v in _dispatch_fields(moe_dispatch))})")
    lines.append((f"{_layer_list(moe_layers)} (moe): {where}", False))
  return lines


_MLA_CORES = {"dense": "dense [T, T] scores in XLA",
              "blockwise": "blockwise in XLA (block {b}, O(T x block) memory)",
              "cudnn": "cuDNN flash attention (jax.nn.dot_product_attention)",
              "triton": "Pallas Triton flash attention (tiles from block {b})",
              "splash": "Pallas splash attention (tiles from block {b})"}


def _mla_line(cfg: ModelConfig, compute: ComputeConfig, backend: str,
              capability: str | None, layers: list[int]) -> tuple[str, bool]:
  """The training core of the MLA layers, resolved for packed (segment ids) batches in the
  compute dtype, at T just under and just over the XLA cost rule's switch."""
  m, block = cfg.mla, compute.mla_block
  facts = dict(backend=backend, block=block, head_dim=m.qk_head_dim, v_head_dim=m.v_head_dim,
               dtype=compute.dtype, has_segments=True, compute_capability=capability)
  short = attention_backends.resolve_impl(compute.mla_impl, seq_len=4 * block, **facts)
  name, why = attention_backends.resolve_impl(compute.mla_impl, seq_len=4 * block + 1, **facts)
  if short[0] == name:
    core = _MLA_CORES[name].format(b=block)
  else:  # the XLA cost rule
    why = why.split(":")[0]  # "compute.mla_impl='auto' on cpu"
    core = (f"{_MLA_CORES[short[0]]} up to T = {4 * block}, "
            f"{_MLA_CORES[name].format(b=block)} beyond")
  # A fallback: a kernel was asked for (explicitly, or by "auto" on an accelerator), XLA runs.
  fallback = (name in attention_backends.XLA_CORES
              and compute.mla_impl not in attention_backends.XLA_CORES
              and (compute.mla_impl != "auto" or backend in attention_backends.AUTO_ORDER))
  return (f"{_layer_list(layers)} (mla): {core} ({why}); cached decode: absorbed latent "
          "attention, blockwise online softmax", fallback)


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
