"""Held-out evaluation during a run: mean NLL per target token and bits per byte, the
curriculum's stage-end evaluations (at the stage's own length and at the evaluation length)
and the `on_stage_end` hook, and the stage fields that go with each log record.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from hybridmoe_jax.data.tokenizers.byte import ByteTokenizer
from hybridmoe_jax.train import stage_plan as plan_lib
from hybridmoe_jax.train import step as step_lib
from hybridmoe_jax.train.monitor import Monitor


def evaluate(eval_step, state, batches, token_bytes: np.ndarray | None = None
             ) -> dict[str, float]:
  """Mean held-out NLL per target token and bits per byte.

  token_bytes: int32 [vocab] UTF-8 bytes of each id (`Tokenizer.token_bytes()`; default
  the byte tokenizer's): the bytes of the held-out text are the sum over its targets.
  """
  if token_bytes is None:
    token_bytes = ByteTokenizer(vision=True).token_bytes()
  token_bytes = np.asarray(token_bytes)
  nll = count = nbytes = 0.0
  for b in batches:
    n, c = eval_step(state.params, state.biases, step_lib.model_inputs(b), state.rest)
    targets, weights = step_lib.next_token_targets(np.asarray(b["tokens"]),
                                                   np.asarray(b["segment_ids"]))
    nll += float(n)
    count += float(c)
    # Every process holds the same held-out rows (nll and count cover all of them).
    targets = np.clip(np.asarray(targets), 0, len(token_bytes) - 1)  # check_batch bounds ids
    nbytes += float(np.sum(np.asarray(weights) * token_bytes[targets])) * jax.process_count()
  if not count:
    return {}
  # Special targets (EOS) hold no bytes; their NLL is charged to the text, as usual for bpb.
  return {"loss": nll / count, "bits_per_byte": nll / max(nbytes, 1.0) / math.log(2),
          "tokens": count}


def stage_info(it, step: int, plan: plan_lib.Plan) -> dict[str, int]:
  """Curriculum runs: stage, seq_len of the last batch and tokens seen; else {}."""
  stage = getattr(it, "stage", None)
  if stage is None:
    return {}
  return {"stage": stage, "seq_len": it.batch_shape[1], "tokens_seen": plan.tokens_seen(step)}


def eval_info(data, step: int, plan: plan_lib.Plan, batches=None) -> dict[str, int]:
  """`stage_info` plus the held-out batches' length (curriculum runs)."""
  info = stage_info(data.train, step, plan)
  batches = data.eval_batches if batches is None else batches
  if info and batches:
    info["eval_seq_len"] = int(np.asarray(batches[0]["tokens"]).shape[1])
  return info


def stage_end(step: int, state, *, plan: plan_lib.Plan, data, eval_step, monitor: Monitor,
              token_bytes: np.ndarray, on_stage_end) -> None:
  """A curriculum stage ended at `step`: held-out loss at the stage's own length and at the
  evaluation length, then `on_stage_end(step, stage, state)` (its dict goes to the JSONL)."""
  stage = plan.stage_at(step - 1)
  own = getattr(data, "stage_eval_batches", {}).get(stage.seq_len)
  for batches in ([own] if own else []) + [data.eval_batches]:
    monitor.log_eval(step, evaluate(eval_step, state, batches, token_bytes),
                     eval_info(data, step, plan, batches))
  run_stage_hook(on_stage_end, step, stage, state, monitor)


def run_stage_hook(on_stage_end, step: int, stage: plan_lib.StagePlan, state,
                   monitor: Monitor) -> None:
  """on_stage_end(step, stage, state) if given; a dict it returns goes to metrics.jsonl."""
  if on_stage_end is not None:
    record = on_stage_end(step, stage, state)
    if record:
      monitor.write_jsonl({"step": step, "stage": stage.index, **record})
