"""Kimi Delta Attention (KDA): one entry point, one dispatch table (`choose`).

Implementations (`TABLE`): "recurrent" (`recurrent.py`, the token scan: the exact
reference), "chunked" (`chunked.py`, XLA), "pallas" (pallas_kernels/kda: its TPU or GPU
kernel, interpreted without either), and under an execution plan with a context runner
(`ops.plan`) "context" (a whole sequence shard by shard) and "context_continue" (a prompt
continuing a context-sharded decode cache).

Conventions (DESIGN s1): B batch, T tokens, H q/k heads, HV value heads (a multiple of H),
K key dim, V value dim, C chunk length.
    q, k: [B, T, H, K]   L2-normalised (the op does not normalise)
    v:    [B, T, HV, V]  value head h reads q/k head h // (HV // H)
    g:    [B, T, HV, K]  per-channel log decay, <= 0;   beta: [B, T, HV] in (0, 1)
    state [B, HV, K, V] float32;  o: [B, T, HV, V] in v's dtype
Per token: S <- diag(e^g_t) S;  S <- S + beta_t k_t (v_t - k_t^T S)^T;  o_t = scale q_t^T S.
The contract is flash-linear-attention's naive_recurrent_kda (plus segment_ids).
"""

from __future__ import annotations

from typing import Callable, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp

from pallas_kernels.kda import check_domain_dims, kda_pallas

from ..decay import check_lower_bound
from ..plan import ExecutionPlan, current_plan, run_local
from ..platform import GPU_PLATFORMS, on_row_shards, target_platform
from .chunked import check_chunk_size, kda_chunked
from .recurrent import check_kda_inputs, kda_recurrent

Impl = Literal["auto", "recurrent", "chunked", "pallas"]


def _pallas(kernel: str):
  """The Pallas kernel `kernel` ("tpu" / "gpu"), packed sequences included; under a mesh on
  each device's rows (`ops.platform.on_row_shards`: XLA cannot partition a kernel call)."""

  def run(q, k, v, g, beta, *, initial_state, segment_ids, interpret, **kwargs):
    body = lambda q, k, v, g, beta, s0, seg: kda_pallas(  # noqa: E731
        q, k, v, g, beta, backend=kernel, interpret=interpret, initial_state=s0,
        segment_ids=seg, **kwargs)
    return on_row_shards(body, q, k, v, g, beta, initial_state, segment_ids)

  return run


class Row(NamedTuple):
  """One implementation: run(q, k, v, g, beta, *, scale, initial_state, output_final_state,
  segment_ids, chunk_size, lower_bound, interpret) -> (o, final state or None)."""

  run: Callable
  platforms: tuple[str, ...]  # where it compiles natively; () = every platform (XLA)
  picked: str  # when `choose` picks it


# The implementation table: the only one for KDA (`choose` picks a row).
TABLE = {
    "recurrent": Row(lambda *x, chunk_size, lower_bound, interpret, **kw: kda_recurrent(*x, **kw),
                     (), "requested: the token scan, the exact reference"),
    "chunked": Row(lambda *x, interpret, **kw: kda_chunked(*x, **kw), (),
                   "auto on CPU, and for inputs outside the kernels' domain"),
    "pallas_tpu": Row(_pallas("tpu"), ("tpu",),
                      "auto on TPU inside the kernel's domain (config.check_domain_dims)"),
    "pallas_gpu": Row(_pallas("gpu"), GPU_PLATFORMS,
                      "auto on GPU inside the kernel's domain (config.check_domain_dims)"),
}


class Choice(NamedTuple):
  """`choose`'s answer: name in ("context", "context_continue", "recurrent", "chunked",
  "pallas") and why; for "pallas" the TABLE row and whether it runs interpreted (no GPU/TPU
  target); fallback: "auto" on a GPU/TPU target got XLA (the kernel refused the input)."""

  name: str
  reason: str
  row: str | None = None
  interpret: bool = False
  fallback: bool = False


def choose(impl: Impl, *, head_dim: int, v_head_dim: int, chunk_size: int,
           lower_bound: float | None, tokens: int = 1, continues: bool = False,
           plan: ExecutionPlan | None = None, backend: str | None = None) -> Choice:
  """Which implementation `kda(..., impl=impl)` runs, and why: in order the plan (a context
  runner), the explicit impl, the target platform, the Pallas kernels' static domain.

  Args:
    impl ("auto" picks); head_dim, v_head_dim: K, V; chunk_size: C; lower_bound: the bounded
      gate's lb (None: unbounded); tokens: T; continues: a state comes in or goes out.
    plan: default the current one; backend: a jax platform name, default the one the
      program is compiled for (`ops.platform.target_platform`).
  Returns:
    Choice (for "auto" falling back to "chunked", the reason is the Pallas domain error).
  """
  if impl not in get_args(Impl):
    raise ValueError(f"impl must be one of {get_args(Impl)}, got {impl!r}")
  plan = current_plan() if plan is None else plan
  if plan.context is not None and not continues:
    return Choice("context", f"sequence shards of {type(plan.context).__name__} (plan)")
  if plan.shards_cache and continues and tokens > 1:
    return Choice("context_continue", "a prompt sharded over the context axis (plan)")
  where = ""
  if backend is None:
    backend, source = target_platform()
    where = f" ({source})"
  row = "pallas_tpu" if backend == "tpu" else "pallas_gpu"
  interpret = backend not in TABLE[row].platforms
  if impl != "auto":
    return Choice(impl, "requested", *((row, interpret) if impl == "pallas" else ()))
  if interpret:
    return Choice("chunked", f"the Pallas kernels target GPU/TPU, the target is {backend!r}"
                  f"{where}")
  try:
    check_domain_dims(head_dim, v_head_dim, lower_bound=lower_bound, chunk_size=chunk_size,
                      backend=row[len("pallas_"):])
  except NotImplementedError as e:
    return Choice("chunked", str(e), fallback=True)
  return Choice("pallas", f"Pallas kernel on {backend}{where}", row)


def _check_gate_range(g: jax.Array, lower_bound: float) -> None:
  """With concrete gates, rejects any g outside [lower_bound, 0] (e.g. a positive g, or an
  unbounded gate passed to the bounded path). Traced gates cannot be inspected: skipped."""
  if isinstance(g, jax.core.Tracer):
    return
  g = jnp.asarray(g)
  g_max, g_min = float(jnp.max(g)), float(jnp.min(g))
  if g_max > 0.0:
    raise ValueError(f"g must be <= 0 (log decay), got max {g_max} in g of shape {g.shape} "
                     f"(positive g with the bounded path, lower_bound={lower_bound})")
  if g_min < lower_bound:
    raise ValueError(f"g must be >= lower_bound={lower_bound}, got min {g_min} in g of "
                     f"shape {g.shape}")


def kda(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
        scale: float | None = None, initial_state: jax.Array | None = None,
        output_final_state: bool = False, segment_ids: jax.Array | None = None,
        chunk_size: int = 64, impl: Impl = "auto", lower_bound: float | None = None
        ) -> tuple[jax.Array, jax.Array | None]:
  """Gated delta rule with per-channel decay (KDA), arXiv:2510.26692.

  Args:
    q, k: [B, T, H, K] L2-normalised queries/keys (any float dtype).
    v: [B, T, HV, V] values.
    g: [B, T, HV, K] log decay <= 0 (float32 recommended).
    beta: [B, T, HV] write strength.
    scale: query scale; defaults to K ** -0.5.
    initial_state: optional [B, HV, K, V] float32 state for the first token's segment.
    output_final_state: also return the final state.
    segment_ids: optional [B, T] integer ids of packed documents; state resets where the id
      changes and documents never interact.
    chunk_size: C for the chunked paths, a power of two >= 16.
    impl: "recurrent" (token scan, exact reference), "chunked" (XLA), "pallas" (kernel),
      or "auto": pallas on GPU/TPU when it accepts the input, else chunked. A plan with a
      context runner overrides it (`choose`): whole sequences (no initial_state) run
      shard by shard, and so does a prompt continuing a context-sharded cache.
    lower_bound: the bounded gate's lb in [-5, 0); lets the chunked paths use dense
      diagonal blocks. Concrete gates are checked against it.

  Returns:
    (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] float32 or None).

  Raises:
    ValueError: bad shapes, impl, chunk_size or lower_bound, or concrete gates outside
      [lower_bound, 0].
    NotImplementedError: impl="pallas" where no kernel can take the input.
  """
  check_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
  plan = current_plan()
  choice = choose(impl, head_dim=q.shape[-1], v_head_dim=v.shape[-1],
                  chunk_size=chunk_size, lower_bound=lower_bound, tokens=q.shape[1],
                  continues=initial_state is not None or output_final_state, plan=plan)
  check_chunk_size(chunk_size)
  if lower_bound is not None:
    check_lower_bound(lower_bound)
    _check_gate_range(g, lower_bound)
  opts = dict(scale=scale, chunk_size=chunk_size, lower_bound=lower_bound)
  state = dict(initial_state=initial_state, output_final_state=output_final_state,
               segment_ids=segment_ids)
  if choice.name == "pallas":  # explicit impl="pallas" outside the domain: refused, not run
    check_domain_dims(q.shape[-1], v.shape[-1], lower_bound=lower_bound,
                      chunk_size=chunk_size, backend=choice.row[len("pallas_"):])
  if choice.name == "context":
    return run_local(plan.context.kda, q, k, v, g, beta, segment_ids=segment_ids, impl=impl,
                     **opts), None
  if choice.name == "context_continue":
    return run_local(plan.context.kda_continue, q, k, v, g, beta,
                     initial_state=initial_state, impl=impl, **opts)
  row = TABLE[choice.row or choice.name]
  return row.run(q, k, v, g, beta, **opts, **state, interpret=choice.interpret)
