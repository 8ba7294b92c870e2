"""Readable trajectories: a Trajectory as a JSON-able record, JSONL logs, a text transcript.

A record (`trajectory_record`) holds plain python only (str, int, float, None, lists,
dicts), so `json.loads(json.dumps(r)) == r`:
    env, level, seed, group, sample_seed   the episode
    reward (float in [0, 1]), finish_reason (str), num_turns (assistant turns)
    total_tokens (prompt, turns, tool results), prompt_tokens, generated_tokens (loss mask)
    turns: one dict per message, in order:
      {"role", "text"}                   system / user / tool_result
      {"role": "assistant", "text", "action", ..., "tokens", "forced_tokens", "mean_logp"}
        text: the turn's ids exactly as sampled, decoded (token-in/token-out: never a
          re-encoding), special ids written as <name> (e.g. "<tool_call>calculator 3 * 4
          <end_turn>"); action: "tool_call" (+ "tool", "argument"), "answer" (+ "answer")
          or "malformed" (+ "error"); tokens: the turn's generated tokens (sampled or
          forced), forced_tokens: those a forced script supplied; mean_logp: their mean
          log-probability under the model's raw logits (None for an empty turn).
    info: the last environment step's info, JSON-able values only (others as repr strings).

`write_trajectories(path, records)` appends one JSON line per record (append mode: a
resumed run keeps the earlier lines).
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable

import numpy as np

from hybridmoe_jax.rl.envs.base import Answer, Malformed, ToolCall
from hybridmoe_jax.rl.episode import Trajectory


def decode_with_specials(tokenizer, ids) -> str:
  """ids int [k] -> text, each special id as <role> (e.g. <end_turn>), ids outside the
  vocabulary as <id N>; runs of ordinary ids go through tokenizer.decode together (so a
  multi-byte character split over byte ids decodes whole)."""
  names = {int(v): k for k, v in tokenizer.special_ids.items()}
  out, run = [], []

  def flush():
    if run:
      out.append(tokenizer.decode(np.asarray(run, np.int32)))
      run.clear()

  for i in (int(t) for t in np.asarray(ids).reshape(-1)):
    if i in names or not 0 <= i < tokenizer.vocab_size:
      flush()
      out.append(f"<{names[i]}>" if i in names else f"<id {i}>")
    else:
      run.append(i)
  flush()
  return "".join(out)


def _action_fields(action) -> dict:
  if isinstance(action, ToolCall):
    return {"action": "tool_call", "tool": action.name, "argument": action.argument}
  if isinstance(action, Answer):
    return {"action": "answer", "answer": action.text}
  if isinstance(action, Malformed):
    return {"action": "malformed", "error": action.error}
  return {"action": None}


def _plain(value):
  """A JSON-able copy of an info value (numpy scalars -> python, unknown -> repr)."""
  if isinstance(value, (str, bool)) or value is None:
    return value
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    return float(value) if math.isfinite(value) else repr(float(value))
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return repr(value)


def trajectory_record(traj: Trajectory, tokenizer) -> dict:
  """A finished Trajectory as a JSON-able dict (see the module docstring).

  Args:
    traj: a rollout's Trajectory (its messages index its turn_index).
    tokenizer: the rollout's tokenizer (with the chat roles).
  """
  turns = []
  for i, m in enumerate(traj.messages):
    if m.role != "assistant":
      turns.append({"role": m.role, "text": m.text})
      continue
    at = (traj.turn_index == i) & (traj.loss_mask == 1)
    logp = traj.logp[at]
    ids = m.ids if m.ids is not None else traj.ids[at]
    turns.append({"role": "assistant", "text": decode_with_specials(tokenizer, ids),
                  **_action_fields(m.action), "tokens": int(at.sum()),
                  "forced_tokens": int(traj.forced[at].sum()),
                  "mean_logp": float(logp.mean()) if logp.size else None})
  s = traj.spec
  return {"env": s.env, "level": int(s.level), "seed": int(s.seed), "group": int(s.group),
          "sample_seed": int(s.sample_seed), "reward": float(traj.reward),
          "finish_reason": str(traj.finish_reason), "num_turns": int(traj.num_turns),
          "total_tokens": int(len(traj.ids)), "prompt_tokens": int(traj.prompt_len),
          "generated_tokens": int(traj.generated), "turns": turns,
          "info": _plain(dict(traj.info))}


def write_trajectories(path: str, records: Iterable[dict]) -> int:
  """Appends each record as one JSON line to `path` (created with its directory if
  missing; earlier lines are kept). Returns the number of lines written."""
  lines = [json.dumps(r, ensure_ascii=False, allow_nan=False) for r in records]
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  with open(path, "a", encoding="utf-8") as f:
    f.write("".join(line + "\n" for line in lines))
  return len(lines)

