"""Which implementation each layer of a model resolves to, and why: one report at startup.

Each line is the op's own dispatch table (`ops.kda.choose`, `ops.attention.api.choose`,
`layers.moe.choose`) asked under the run's execution plan (`ops.plan`): a run's log should
say which implementation it got instead of leaving a silent fallback to be discovered in a
profile (`log_impls` warns).
"""

from __future__ import annotations

from absl import logging

from hybridmoe_jax.config import ComputeConfig, ModelConfig
from hybridmoe_jax.layers import moe
from hybridmoe_jax.ops import grouped_ffn
from hybridmoe_jax.ops.attention import api as attention
from hybridmoe_jax.ops.kda import choose as kda_choose
from hybridmoe_jax.ops.plan import LOCAL, ExecutionPlan


def _layer_list(indices: list[int]) -> str:
  return ("layer " if len(indices) == 1 else "layers ") + ",".join(map(str, indices))


def describe_impls(cfg: ModelConfig, compute: ComputeConfig, *,
                   plan: ExecutionPlan = LOCAL, backend: str | None = None) -> list[str]:
  """One line per layer kind: the implementation it runs on `backend` and the reason.

  Args:
    cfg: the architecture; compute: the runtime knobs (kda_impl, kda_chunk_size, mla_impl,
      mla_block, moe_impl).
    plan: the execution plan the model's steps are traced under (`Runtime.plan`).
    backend: a jax platform name; default the target platform (`ops.platform`: the active
      mesh's devices, else the host's backend; and a local GPU's compute capability).
  """
  return [line for line, _ in _report(cfg, compute, plan, backend)]


def log_impls(cfg: ModelConfig, compute: ComputeConfig, *, plan: ExecutionPlan = LOCAL,
              backend: str | None = None) -> None:
  """Logs `describe_impls` (absl): a line whose accelerator kernel fell back to XLA as a
  warning, the others as info."""
  for line, fallback in _report(cfg, compute, plan, backend):
    (logging.warning if fallback else logging.info)("implementation: %s", line)


def _report(cfg: ModelConfig, compute: ComputeConfig, plan: ExecutionPlan,
            backend: str | None) -> list[tuple[str, bool]]:
  """(line, fell back from an accelerator kernel to XLA) per layer kind."""
  capability, given = None, backend
  if backend is None:  # the platform the program is compiled for (the mesh's devices)
    backend, capability = attention.current_backend()
  kinds = cfg.layer_kinds
  lines = []
  kda_layers = [i for i, k in enumerate(kinds) if k == "kda"]
  if kda_layers:
    k = cfg.kda
    c = kda_choose(compute.kda_impl, head_dim=k.head_dim, v_head_dim=k.v_head_dim,
                   chunk_size=compute.kda_chunk_size,
                   lower_bound=k.lower_bound if k.gate == "bounded" else None,
                   tokens=2, continues=False, plan=plan, backend=given)
    lines.append((f"{_layer_list(kda_layers)} (kda): {c.name} (chunk {compute.kda_chunk_size}; "
                  f"compute.kda_impl={compute.kda_impl!r}: {c.reason}); one-token decode: "
                  "recurrent", c.fallback))
  mla_layers = [i for i, k in enumerate(kinds) if k == "mla"]
  if mla_layers:
    lines.append(_mla_line(cfg, compute, plan, backend, capability, mla_layers))
  moe_layers = list(cfg.moe_layers)
  if moe_layers:
    experts, why = moe.choose(compute.moe_impl, plan)
    matmul = (f"; grouped matmul {grouped_ffn.choose('auto', backend)[1]}"
              if experts in ("ragged", "dispatch") else "")
    lines.append((f"{_layer_list(moe_layers)} (moe): {why}"
                  f"{matmul}", False))
  return lines


_MLA_CORES = {"context": "absorbed over the context shards",
              "dense": "dense [T, T] scores in XLA",
              "blockwise": "blockwise in XLA (block {b}, O(T x block) memory)",
              "cudnn": "cuDNN flash attention (jax.nn.dot_product_attention)",
              "triton": "Pallas Triton flash attention (tiles from block {b})",
              "splash": "Pallas splash attention (tiles from block {b})"}


def _mla_line(cfg: ModelConfig, compute: ComputeConfig, plan: ExecutionPlan, backend: str,
              capability: str | None, layers: list[int]) -> tuple[str, bool]:
  """The training core of the MLA layers, resolved for packed (segment ids) batches in the
  compute dtype, at T just under and just over the XLA cost rule's switch."""
  m, block = cfg.mla, compute.mla_block
  facts = dict(backend=backend, block=block, head_dim=m.qk_head_dim, v_head_dim=m.v_head_dim,
               dtype=compute.dtype, has_segments=True, compute_capability=capability)
  choose = lambda t: attention.choose(compute.mla_impl, plan=plan, seq_len=t, **facts)
  short, (name, why) = choose(4 * block), choose(4 * block + 1)
  if short[0] == name:
    core = _MLA_CORES[name].format(b=block)
  else:  # the XLA cost rule
    why = why.split(":")[0]  # "compute.mla_impl='auto' on cpu"
    core = (f"{_MLA_CORES[short[0]]} up to T = {4 * block}, "
            f"{_MLA_CORES[name].format(b=block)} beyond")
  # A fallback: a kernel was asked for (explicitly, or by "auto" on an accelerator), XLA runs.
  fallback = (name in attention.XLA_CORES
              and compute.mla_impl not in attention.XLA_CORES
              and (compute.mla_impl != "auto" or backend in attention.AUTO_ORDER))
  return (f"{_layer_list(layers)} (mla): {core} ({why}); cached decode: "
          f"{attention.choose_cached(plan)[1]}", fallback)
