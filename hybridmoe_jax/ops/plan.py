"""Where the ops of the current trace run: the execution plan.

A model is one graph; where its ops run (a context-parallel runner over sequence shards, an
expert-parallel MoE dispatch) is a property of the program being traced, not of the model.
`parallel.runtime` builds the plan from the mesh; the train/eval steps, the AOT compiler and
the context-parallel engine enter it around tracing (`with execution_plan(plan): ...`), and
each op's dispatcher (`ops.kda.kda`, `ops.conv.short_conv`, the MLA and MoE layers' cores)
reads it at trace time. Outside any `with`, the plan is LOCAL: everything on this device.
The plan carries the runners as objects, so ops never import `parallel`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
  """context: a context-parallel runner (`parallel.context.ContextParallel`; its subclass
  `parallel.context_decode.ContextDecode` also holds the decode cache sharded over the
  sequence), or None: whole sequences on each device.
  moe_dispatch: the routed experts' dispatch (`parallel.ep_moe.ExpertParallelDispatch`), or
  None: local experts (`compute.moe_impl`).
  Hashable: jitted functions may key their programs on it."""

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
  """fn(*args, **kwargs) under the LOCAL plan: a runner's per-shard body calls the same ops
  and must get their local implementations, not the runner again."""
  with execution_plan(LOCAL):
    return fn(*args, **kwargs)
