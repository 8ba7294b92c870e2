"""Series out of `metrics.jsonl` records (the dicts the training Monitor writes).

Record kinds: {"event": "start"|"resume", "step"}; train logs {"step", "split": "train",
"loss", "tokens_per_sec", "alerts", "moe": {layer: {max_vio, bias_min, bias_max, load}},
curriculum runs add "stage", "seq_len"}; evals {"step", "split": "eval", "loss",
"bits_per_byte"}. A step logged twice (redone after a resume) keeps its last record.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import numpy as np

Record = dict[str, Any]


def split_records(records: Iterable[Record], split: str, *, field: str = "split"
                  ) -> list[Record]:
  """Records of one split ("train" / "eval"; with field="event", of one RL event: "sft",
  "rl", "eval") in step order, the last one per step (a resumed run redoes the steps after
  its checkpoint)."""
  by_step = {}
  for r in records:
    if r.get(field) == split and isinstance(r.get("step"), int):
      by_step[r["step"]] = r
  return [by_step[s] for s in sorted(by_step)]


def series(records: Sequence[Record], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of `key` over records holding it as a finite number."""
  pts = [(r["step"], float(r[key])) for r in records
         if isinstance(r.get(key), (int, float)) and np.isfinite(float(r[key]))]
  if not pts:
    return np.zeros(0, np.int64), np.zeros(0)
  steps, values = zip(*pts)
  return np.asarray(steps), np.asarray(values, np.float64)


def layer_names(records: Sequence[Record]) -> list[str]:
  """MoE layer names of the train records, in layer order ("layers/1/ffn" < "layers/10/ffn")."""
  names = {n for r in records for n in (r.get("moe") or {})}
  return sorted(names, key=lambda s: (len(s), s))


def moe_series(records: Sequence[Record], layer: str, key: str
               ) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of one MoE statistic ("max_vio", "bias_min", ...) of one layer."""
  flat = [{"step": r["step"], key: r["moe"][layer][key]} for r in records
          if key in (r.get("moe") or {}).get(layer, {})]
  return series(flat, key)


def stage_starts(train: Sequence[Record]) -> list[tuple[int, int, int | None]]:
  """(first logged step, stage, seq_len) each time the curriculum stage changes."""
  out, last = [], None
  for r in train:
    if "stage" in r and r["stage"] != last:
      last = r["stage"]
      out.append((r["step"], int(r["stage"]), r.get("seq_len")))
  return out


def event_steps(records: Iterable[Record], event: str) -> list[int]:
  return [int(r["step"]) for r in records if r.get("event") == event]


def layer_label(name: str) -> str:
  """"layers/3/ffn" -> "layer 3"; any other name unchanged."""
  m = re.fullmatch(r"layers/(\d+)/ffn", name)
  return f"layer {m.group(1)}" if m else name
