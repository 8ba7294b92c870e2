"""Where the ops of the current trace run: one model graph, many placements. Built by
`parallel.runtime`, entered while tracing (`with execution_plan(plan): ...`; LOCAL outside),
read by each op's dispatch table; it carries the runners, so ops never import `parallel`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
  """Hashable (jitted functions may key their programs on it).

  context: None (whole sequences on each device) or a context-parallel runner
    (`parallel.context.ContextParallel`): short_conv / kda / latent_attention over the
    sequence shards; splits(B, T), flatten_tokens, unflatten_tokens and tokenwise(fn,
    per_token, shared) run token-wise work (MoE routing) on each device's own tokens.
    Its subclass `parallel.context_decode.ContextDecode` (shards_cache) also holds the
    decode cache split over the sequence: kda_continue, cached_latent_attention.
  moe_dispatch: None (local experts, `compute.moe_impl`) or a callable (x [m, n_in], routes,
    bias [E], valid [m], w_gate, w_up, w_down, *, cfg, glu, dtype, stats_routes=None) ->
    (y [m, n_in] fp32, routing stats of all m tokens) that runs the routed experts
    elsewhere (`parallel.ep_moe.ExpertParallelDispatch`).
  """

  context: Any = None
  moe_dispatch: Any = None

  @property
  def shards_cache(self) -> bool:
    """True when the decode cache is sharded over the context axis (`ContextDecode`)."""
    return bool(getattr(self.context, "shards_cache", False))


LOCAL = ExecutionPlan()
_PLAN: contextvars.ContextVar[ExecutionPlan] = contextvars.ContextVar("plan", default=LOCAL)


def current_plan() -> ExecutionPlan:
  """The plan of the trace in progress (LOCAL outside any `execution_plan`)."""
  return _PLAN.get()


@contextlib.contextmanager
def execution_plan(plan: ExecutionPlan | None) -> Iterator[ExecutionPlan]:
  """Runs the block (and what it traces) under `plan` (None: LOCAL)."""
  token = _PLAN.set(LOCAL if plan is None else plan)
  try:
    yield _PLAN.get()
  finally:
    _PLAN.reset(token)


def run_local(fn, *args, **kwargs):
  """fn(*args, **kwargs) under LOCAL: a runner's per-shard body calls the same ops, which
  must then run here, not call the runner again."""
  with execution_plan(LOCAL):
    return fn(*args, **kwargs)
