"""The run's plan: its stages (global batch, length, mix, learning-rate piece), built once.

A curriculum (`curriculum.stages`) is an ordered list of stages of strictly increasing
sequence length. Tokens per optimizer step are `curriculum.tokens_per_step` unless a stage
raises its own (`stages[k].tokens_per_step`: one 32K row cannot fit an 8K step), and each
stage's global batch is its tokens_per_step // seq_len (an error if that does not divide),
and the learning rate is one piecewise function of the global step: one `optim.LRPiece` per
stage (`optim.make_schedule`). A run without a curriculum is a one-stage plan of
train.batch_size x train.seq_len for train.steps whose piece is the train section's
warmup + cosine / wsd / constant schedule, so every run has the same single scheduler.

Stage learning rate (`run_config.StageConfig`): linear from `warmup_from` (None: where the
previous stage ended; 0 for the first) to `lr` over `warmup` steps, then "constant",
"cosine" / "linear" to lr * min_lr_ratio at the stage end, or "wsd" (constant, then linear
decay over the last decay_fraction).
"""

from __future__ import annotations

import dataclasses

from hybridmoe_jax.config.run import RunConfig, StageConfig
from hybridmoe_jax.train import optim


@dataclasses.dataclass(frozen=True)
class StagePlan:
  """One stage, resolved: global batch, global start step, mixing weights, LR piece."""

  index: int
  name: str
  seq_len: int
  batch_size: int
  steps: int
  start_step: int
  tokens_per_step: int        # seq_len * batch_size
  start_tokens: int           # tokens seen before this stage
  weights: dict[str, float]   # {source name: weight > 0}; {} for a plain run
  long_upsample: int
  long_min_bytes: int
  retrieval_fraction: float
  lr: optim.LRPiece
  retrieval_answer_weight: float = 1.0
  retrieval_kinds: tuple[str, ...] = ("passkey", "multikey", "kv")
  retrieval_bytes: tuple[int, int] = (0, 0)

  @property
  def end_step(self) -> int:
    return self.start_step + self.steps


@dataclasses.dataclass(frozen=True)
class Plan:
  tokens_per_step: int  # the curriculum's (a stage may raise its own)
  stages: tuple[StagePlan, ...]
  curriculum: bool  # False: the one stage of a plain run (its data: the `data` section)

  @property
  def total_steps(self) -> int:
    return self.stages[-1].end_step

  def tokens_seen(self, step: int) -> int:
    """Training tokens in the first `step` optimizer steps."""
    s = self.stage_at(max(step - 1, 0))
    return s.start_tokens + (min(step, s.end_step) - s.start_step) * s.tokens_per_step

  def stage_at(self, step: int) -> StagePlan:
    """The stage that step `step` (0-based: the step run from state.step == step) belongs to."""
    for s in self.stages:
      if step < s.end_step:
        return s
    return self.stages[-1]

  def lr_pieces(self) -> tuple[optim.LRPiece, ...]:
    return tuple(s.lr for s in self.stages)

  def schedule(self):
    """The run's learning rate as a function of the applied updates (`optim.make_schedule`)."""
    return optim.make_schedule(self.lr_pieces())


def _plain_plan(run: RunConfig) -> Plan:
  t = run.train
  lr = optim.LRPiece(start=0, steps=t.steps, lr_from=0.0, lr=t.lr,
                     warmup=min(t.warmup, t.steps), schedule=t.schedule,
                     min_lr_ratio=t.min_lr_ratio, decay_fraction=t.decay_fraction)
  stage = StagePlan(index=0, name="train", seq_len=t.seq_len, batch_size=t.batch_size,
                    steps=t.steps, start_step=0, tokens_per_step=t.batch_size * t.seq_len,
                    start_tokens=0, weights={}, long_upsample=1,
                    long_min_bytes=t.seq_len // 2, retrieval_fraction=0.0, lr=lr)
  return Plan(t.batch_size * t.seq_len, (stage,), curriculum=False)


def _lr_piece(st: StageConfig, start: int, steps: int, base_lr: float,
              prev: optim.LRPiece | None) -> optim.LRPiece:
  lr = base_lr if st.lr is None else st.lr
  if st.warmup_from is None:
    lr_from = 0.0 if prev is None else optim.piece_value(prev, prev.steps)
  else:
    lr_from = st.warmup_from
  return optim.LRPiece(start=start, steps=steps, lr_from=float(lr_from), lr=float(lr),
                       warmup=st.warmup, schedule=st.schedule, min_lr_ratio=st.min_lr_ratio,
                       decay_fraction=st.decay_fraction)


def _retrieval_bytes(given: tuple[int, int], seq_len: int) -> tuple[int, int]:
  """A stage's (shortest, longest) retrieval document in bytes; 0 takes the default: the row
  (less BOS / EOS) and a quarter of it, but at least 128."""
  hi = given[1] or seq_len - 2
  return given[0] or min(hi, max(128, (seq_len - 2) // 4)), hi


def build_plan(run: RunConfig) -> Plan:
  """The run's plan (the curriculum was checked against the model, compute and train
  sections when `run` was built: `RunConfig.check`)."""
  c = run.curriculum
  if not c.enabled:
    return _plain_plan(run)
  plans, start, seen, prev_lr = [], 0, 0, None
  for k, st in enumerate(c.stages):
    T, (tps, steps) = st.seq_len, c.sizes(st)
    lr = _lr_piece(st, start, steps, run.train.lr, prev_lr)
    plans.append(StagePlan(
        index=k, name=st.name or f"stage{k}", seq_len=T, batch_size=tps // T, steps=steps,
        start_step=start, tokens_per_step=tps, start_tokens=seen,
        weights={n: v for n, v in st.weights.items() if v > 0},
        long_upsample=st.long_upsample, long_min_bytes=st.long_min_tokens or T // 2,
        retrieval_fraction=st.retrieval_fraction, lr=lr,
        retrieval_answer_weight=st.retrieval_answer_weight,
        retrieval_kinds=tuple(st.retrieval_kinds),
        retrieval_bytes=_retrieval_bytes(st.retrieval_bytes, T)))
    start, seen, prev_lr = start + steps, seen + steps * tps, lr
  return Plan(c.tokens_per_step, tuple(plans), curriculum=True)


def describe(plan: Plan) -> str:
  """The plan as a table (one line per stage)."""
  lines = [f"curriculum: {len(plan.stages)} stages, {plan.tokens_per_step:,} tokens/step, "
           f"{plan.total_steps:,} steps, {plan.tokens_seen(plan.total_steps):,} tokens"]
  for s in plan.stages:
    mix = ", ".join(f"{n} {w:g}" for n, w in s.weights.items())
    extra = (f", retrieval {s.retrieval_fraction:g} ({'/'.join(s.retrieval_kinds)}, answers "
             f"x{s.retrieval_answer_weight:g})" if s.retrieval_fraction else "")
    up = f", long x{s.long_upsample} (>= {s.long_min_bytes} B)" if s.long_upsample > 1 else ""
    lr = s.lr
    lines.append(
        f"  {s.index} {s.name}: seq_len {s.seq_len:,} x batch {s.batch_size}"
        + (f" ({s.tokens_per_step:,} tokens/step)" if s.tokens_per_step != plan.tokens_per_step
           else "") + " | steps "
        f"{s.start_step:,}..{s.end_step:,} | mix {mix}{extra}{up} | lr {lr.lr_from:.2e} -> "
        f"{lr.lr:.2e} (warmup {lr.warmup}) {lr.schedule}"
        + (f" to x{lr.min_lr_ratio:g}" if lr.schedule != "constant" else ""))
  return "\n".join(lines)
