"""The staged context curriculum: `config.curriculum`, its checks, the stage plan and its data.

A curriculum is an ordered list of stages of strictly increasing sequence length. Tokens per
optimizer step are constant (`curriculum.tokens_per_step`), so each stage's global batch is
tokens_per_step // seq_len (an error if that does not divide) and the learning rate is one
piecewise function of the global step (one piece per stage, see `optim.piecewise_schedule`).

Stage fields (a dict per stage; defaults in STAGE_DEFAULTS):
  seq_len            tokens per packed row (a multiple of model.kda.chunk_size)
  steps | tokens     stage length in optimizer steps, or in tokens (a multiple of
                     tokens_per_step); exactly one of the two
  weights            {source name: weight >= 0}; not all zero; names from curriculum.sources
  long_upsample      documents of >= long_min_tokens bytes appear this many times per epoch
  long_min_tokens    0: half the stage's seq_len
  retrieval_fraction share of synthetic passkey / key-value documents in the mix, [0, 0.5]
  lr, warmup, warmup_from, schedule, min_lr_ratio, decay_fraction
                     the stage's learning rate: linear from `warmup_from` (None: where the
                     previous stage ended; 0 for the first) to `lr` over `warmup` steps, then
                     "constant", "cosine" / "linear" to lr * min_lr_ratio at the stage end, or
                     "wsd" (constant, then linear decay over the last decay_fraction)

Sources (`curriculum.sources`, {name: {"kind", "paths", "field"}}): kind "bundled" (pydoc
help texts), "stdlib_long" (standard library sources concatenated per package, long_docs.py),
"text" or "jsonl" (paths). Every source is split into train / held-out documents with
`data.heldout_fraction` / `data.heldout_seed`; held-out batches are packed at the longest
stage length and evaluated at every stage end.

A vision model (model.vision.enabled) gets image-text documents (`data.vision`) mixed into
every stage at the token share data.vision.share, packed by the image-aware packer in-process
(curriculum.num_workers does not apply; one host only).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np

from hybridmoe_jax.config import ConfigError, VisionConfig
from hybridmoe_jax.data import long_docs
from hybridmoe_jax.data import multimodal
from hybridmoe_jax.data import vlm_pipeline
from hybridmoe_jax.data import pipeline as pipeline_lib
from hybridmoe_jax.data import retrieval
from hybridmoe_jax.data import sources as sources_lib
from hybridmoe_jax.data import stages as stages_lib
from hybridmoe_jax.data import tokenizer as tokenizer_lib
from hybridmoe_jax.train import optim

SOURCE_KINDS = ("bundled", "stdlib_long", "text", "jsonl")
STAGE_SCHEDULES = ("constant", "cosine", "linear", "wsd")
STAGE_DEFAULTS = dict(
    name="", seq_len=None, steps=0, tokens=0, weights=None, long_upsample=1,
    long_min_tokens=0, retrieval_fraction=0.0, lr=None, warmup=0, warmup_from=None,
    schedule="constant", min_lr_ratio=1.0, decay_fraction=0.2)


def default_curriculum_config() -> ml_collections.ConfigDict:
  """`config.curriculum` defaults: no stages, i.e. a plain run of train.batch_size x seq_len."""
  c = ml_collections.ConfigDict()
  # Global tokens per optimizer step, constant over stages (0: no curriculum).
  c.tokens_per_step = 0
  # Ordered stage dicts (see the module docstring); empty: no curriculum.
  c.stages = ()
  # Named document sources: {name: {"kind": ..., "paths": (...), "field": "text"}}.
  c.sources = ml_collections.ConfigDict()
  # grain worker processes per host (mp_prefetch); 0 packs in a background thread.
  c.num_workers = 0
  # Rows the first-fit packer fills at once.
  c.num_packing_bins = 16
  # Held-out sequence length; 0: the longest stage's.
  c.eval_seq_len = 0
  return c


def enabled(config: ml_collections.ConfigDict) -> bool:
  return "curriculum" in config and bool(config.curriculum.stages)


def _check(ok: bool, field: str, value: Any, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"config field `{field}` = {value!r} is invalid: allowed {allowed}")


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


# --------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class StagePlan:
  """One stage, resolved: global batch, global start step, mixing weights, LR piece."""

  index: int
  name: str
  seq_len: int
  batch_size: int
  steps: int
  start_step: int
  weights: dict[str, float]
  long_upsample: int
  long_min_bytes: int
  retrieval_fraction: float
  lr: dict[str, Any]  # an optim.piecewise_schedule piece

  @property
  def end_step(self) -> int:
    return self.start_step + self.steps


@dataclasses.dataclass(frozen=True)
class Plan:
  tokens_per_step: int
  stages: tuple[StagePlan, ...]

  @property
  def total_steps(self) -> int:
    return self.stages[-1].end_step

  def stage_at(self, step: int) -> StagePlan:
    """The stage that step `step` (0-based: the step run from state.step == step) belongs to."""
    for s in self.stages:
      if step < s.end_step:
        return s
    return self.stages[-1]

  def lr_pieces(self) -> tuple[dict[str, Any], ...]:
    return tuple(s.lr for s in self.stages)


def _stage_dict(raw, k: int) -> dict[str, Any]:
  where = f"curriculum.stages[{k}]"
  if isinstance(raw, ml_collections.ConfigDict):
    raw = raw.to_dict()
  _check(isinstance(raw, dict), where, raw, "a dict of stage fields")
  unknown = sorted(set(raw) - set(STAGE_DEFAULTS))
  _check(not unknown, where, unknown, f"fields among {sorted(STAGE_DEFAULTS)}")
  return {**STAGE_DEFAULTS, **raw}


def _validate_sources(c) -> list[str]:
  names = list(c.sources.keys()) if c.sources is not None else []
  _check(bool(names), "curriculum.sources", {}, "at least one named source")
  for name in names:
    s = c.sources[name]
    s = s.to_dict() if isinstance(s, ml_collections.ConfigDict) else s
    where = f"curriculum.sources.{name}"
    _check(isinstance(s, dict), where, s, "a dict with `kind` (and `paths` / `field`)")
    unknown = sorted(set(s) - {"kind", "paths", "field"})
    _check(not unknown, where, unknown, "keys among ['field', 'kind', 'paths']")
    _check(s.get("kind") in SOURCE_KINDS, f"{where}.kind", s.get("kind"),
           f"one of {SOURCE_KINDS}")
    paths = s.get("paths", ())
    _check(isinstance(paths, (tuple, list)) and all(isinstance(p, str) and p for p in paths),
           f"{where}.paths", paths, "a tuple of non-empty path strings")
    if s["kind"] in ("text", "jsonl"):
      _check(len(paths) > 0, f"{where}.paths", paths, f"at least one path for kind {s['kind']!r}")
  return names


def _lr_piece(st: dict[str, Any], k: int, start: int, steps: int, base_lr: float,
              prev: dict[str, Any] | None) -> dict[str, Any]:
  w = f"curriculum.stages[{k}]"
  lr = base_lr if st["lr"] is None else st["lr"]
  _check(_is_num(lr) and 0 < lr <= 10, f"{w}.lr", lr, "a float in (0, 10]")
  _check(_is_int(st["warmup"]) and 0 <= st["warmup"] <= steps, f"{w}.warmup", st["warmup"],
         f"an integer in [0, steps={steps}]")
  _check(st["schedule"] in STAGE_SCHEDULES, f"{w}.schedule", st["schedule"],
         f"one of {STAGE_SCHEDULES}")
  for name in ("min_lr_ratio", "decay_fraction"):
    _check(_is_num(st[name]) and 0 <= st[name] <= 1, f"{w}.{name}", st[name],
           "a float in [0, 1]")
  if st["warmup_from"] is None:
    lr_from = 0.0 if prev is None else optim.piece_value(prev, prev["steps"])
  else:
    lr_from = st["warmup_from"]
    _check(_is_num(lr_from) and 0 <= lr_from <= 10, f"{w}.warmup_from", lr_from,
           "None (continue from the previous stage) or a float in [0, 10]")
  return dict(start=start, steps=steps, lr_from=float(lr_from), lr=float(lr),
              warmup=int(st["warmup"]), schedule=st["schedule"],
              min_lr_ratio=float(st["min_lr_ratio"]),
              decay_fraction=float(st["decay_fraction"]))


def build_plan(config: ml_collections.ConfigDict) -> Plan:
  """Validates `config.curriculum` against the model and train sections; -> Plan.

  Raises:
    ConfigError naming the first bad field (stage lengths not increasing, a batch that does
    not divide, negative or all-zero weights, unknown sources, seq_len not a multiple of the
    KDA chunk, ...).
  """
  c, t = config.curriculum, config.train
  _check(_is_int(c.tokens_per_step) and c.tokens_per_step >= 2, "curriculum.tokens_per_step",
         c.tokens_per_step, "an integer >= 2 when curriculum.stages is set")
  _check(isinstance(c.stages, (tuple, list)), "curriculum.stages", c.stages,
         "a tuple of stage dicts")
  _check(_is_int(c.num_workers) and c.num_workers >= 0, "curriculum.num_workers",
         c.num_workers, "an integer >= 0")
  _check(_is_int(c.num_packing_bins) and c.num_packing_bins >= 1,
         "curriculum.num_packing_bins", c.num_packing_bins, "an integer >= 1")
  names = _validate_sources(c)
  chunk = int(config.model.kda.chunk_size)
  has_kda = not config.model.get("layer_kinds") or "kda" in tuple(config.model.layer_kinds)
  tps = int(c.tokens_per_step)
  plans, start, prev_len, prev_lr = [], 0, 0, None
  for k, raw in enumerate(c.stages):
    st, w = _stage_dict(raw, k), f"curriculum.stages[{k}]"
    T = st["seq_len"]
    _check(_is_int(T) and T >= 2, f"{w}.seq_len", T, "an integer >= 2")
    _check(T > prev_len, f"{w}.seq_len", T,
           f"a length > the previous stage's {prev_len} (stage lengths must increase)")
    if has_kda:
      _check(T % chunk == 0, f"{w}.seq_len", T,
             f"a multiple of the KDA chunk size model.kda.chunk_size={chunk}")
    _check(tps % T == 0, f"{w}.seq_len", T,
           f"a divisor of curriculum.tokens_per_step={tps} (batch = tokens_per_step / seq_len)")
    batch = tps // T
    _check(batch % t.grad_accum == 0, f"{w}.seq_len", T,
           f"a length whose batch {batch} is a multiple of train.grad_accum={t.grad_accum}")
    steps, tokens = st["steps"], st["tokens"]
    _check(_is_int(steps) and _is_int(tokens) and steps >= 0 and tokens >= 0
           and (steps > 0) != (tokens > 0), f"{w}.steps/tokens", (steps, tokens),
           "exactly one of `steps` or `tokens` > 0")
    if tokens:
      _check(tokens % tps == 0, f"{w}.tokens", tokens,
             f"a multiple of curriculum.tokens_per_step={tps}")
      steps = tokens // tps
    weights = st["weights"]
    weights = weights.to_dict() if isinstance(weights, ml_collections.ConfigDict) else weights
    _check(isinstance(weights, dict) and weights, f"{w}.weights", weights,
           f"a dict {{source name: weight}} with names among {names}")
    bad = sorted(set(weights) - set(names))
    _check(not bad, f"{w}.weights", bad, f"source names among {names}")
    for n, v in weights.items():
      _check(_is_num(v) and v >= 0 and math.isfinite(v), f"{w}.weights.{n}", v,
             "a finite weight >= 0")
    _check(sum(weights.values()) > 0, f"{w}.weights", weights, "at least one weight > 0")
    _check(_is_int(st["long_upsample"]) and st["long_upsample"] >= 1, f"{w}.long_upsample",
           st["long_upsample"], "an integer >= 1")
    _check(_is_int(st["long_min_tokens"]) and st["long_min_tokens"] >= 0,
           f"{w}.long_min_tokens", st["long_min_tokens"], "an integer >= 0 (0: seq_len // 2)")
    rf = st["retrieval_fraction"]
    _check(_is_num(rf) and 0 <= rf <= 0.5, f"{w}.retrieval_fraction", rf, "a float in [0, 0.5]")
    if rf:
      _check(T >= 64, f"{w}.retrieval_fraction", rf, "0 for stages shorter than 64 tokens")
    lr = _lr_piece(st, k, start, steps, t.lr, prev_lr)
    plans.append(StagePlan(
        index=k, name=st["name"] or f"stage{k}", seq_len=T, batch_size=batch, steps=steps,
        start_step=start, weights={n: float(v) for n, v in weights.items() if v > 0},
        long_upsample=st["long_upsample"],
        long_min_bytes=st["long_min_tokens"] or T // 2, retrieval_fraction=float(rf), lr=lr))
    start, prev_len, prev_lr = start + steps, T, lr
  _check(bool(plans), "curriculum.stages", c.stages, "at least one stage")
  plan = Plan(tps, tuple(plans))
  _check(t.steps <= plan.total_steps, "train.steps", t.steps,
         f"at most the curriculum's {plan.total_steps} steps (the sum of the stage lengths)")
  _check(_is_int(c.eval_seq_len) and c.eval_seq_len >= 0, "curriculum.eval_seq_len",
         c.eval_seq_len, "an integer >= 0 (0: the longest stage)")
  return plan


def validate_curriculum_config(config: ml_collections.ConfigDict) -> None:
  """No-op without stages; otherwise `build_plan` (raises ConfigError)."""
  if enabled(config):
    build_plan(config)


def train_section(config: ml_collections.ConfigDict, plan: Plan | None = None):
  """The `train` section the step and monitor run with.

  Without a curriculum: `config.train` itself. With one: a copy whose learning rate is the
  plan's piecewise schedule (`lr_pieces`, read by `optim.make_schedule`) and whose
  batch_size x seq_len is the first stage's (so tokens per step match every stage).
  """
  if not enabled(config):
    return config.train
  plan = plan or build_plan(config)
  t = ml_collections.ConfigDict(config.train.to_dict())
  t.lr_pieces = plan.lr_pieces()
  t.batch_size, t.seq_len = plan.stages[0].batch_size, plan.stages[0].seq_len
  return t


# --------------------------------------------------------------------------- data
def make_source(kind: str, spec: dict[str, Any]):
  if kind == "bundled":
    return sources_lib.BundledTextSource()
  if kind == "stdlib_long":
    paths = spec.get("paths", ())
    return long_docs.StdlibLongDocSource(paths[0] if paths else None)
  if kind == "text":
    return sources_lib.TextFileSource(list(spec["paths"]))
  return sources_lib.JsonlSource(list(spec["paths"]), field=spec.get("field", "text"))


class _ConcatSource:
  """Documents of several sources one after another (the held-out set)."""

  def __init__(self, parts):
    self.parts = list(parts)
    self.offsets = np.cumsum([0] + [len(p) for p in self.parts])

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getitem__(self, i) -> str:
    k = int(np.searchsorted(self.offsets, int(i), side="right")) - 1
    return self.parts[k][int(i) - int(self.offsets[k])]


@dataclasses.dataclass
class CurriculumData:
  """What the train loop needs for a curriculum run."""

  train: stages_lib.StagedIterator
  eval_batches: list  # held-out int32 [B_eval, T_eval] batches
  tokenizer: tokenizer_lib.ByteTokenizer
  plan: Plan
  eval_at: frozenset  # global steps at which a stage ends (held-out eval there)


def stage_data(plan: Plan, train_sources: dict[str, Any], *, seed: int,
               shard_count: int = 1) -> list[stages_lib.StageData]:
  """Per-stage pipeline inputs (batch per host); retrieval docs join as one more component."""
  out = []
  for s in plan.stages:
    if s.batch_size % shard_count:
      raise ConfigError(f"config field `curriculum.stages[{s.index}].seq_len` = {s.seq_len} is "
                        f"invalid: its global batch {s.batch_size} must split evenly over "
                        f"{shard_count} hosts")
    comps = [stages_lib.Component(n, train_sources[n], w) for n, w in s.weights.items()]
    if s.retrieval_fraction > 0:
      total = sum(s.weights.values())
      comps.append(stages_lib.Component(
          "retrieval", retrieval.RetrievalSource(s.seq_len - 2, seed=seed + 7919 * s.index),
          total * s.retrieval_fraction / (1 - s.retrieval_fraction)))
    out.append(stages_lib.StageData(
        index=s.index, seq_len=s.seq_len, batch_size=s.batch_size // shard_count,
        steps=s.steps, components=tuple(comps), long_upsample=s.long_upsample,
        long_min_bytes=s.long_min_bytes, seed=seed + 1009 * s.index))
  return out


def build_data(config: ml_collections.ConfigDict, vocab_size: int, *,
               vision: VisionConfig | None = None, shard_index: int | None = None,
               shard_count: int | None = None) -> CurriculumData:
  """Validates, indexes every source (all bad input fails here), builds the staged iterator.

  With an enabled `vision` tower every stage mixes image-text documents (`data.vision`) in
  at the constant token share data.vision.share (`vlm_pipeline.vlm_stage_iterator`), and the
  held-out batches add image-text rows at the evaluation length.

  Raises:
    ConfigError: bad curriculum / data fields. ValueError / OSError: a source with no usable
      documents, a missing path, a host shard without documents.
  """
  plan = build_plan(config)
  c, d, t = config.curriculum, config.data, config.train
  shard_index = jax.process_index() if shard_index is None else shard_index
  shard_count = jax.process_count() if shard_count is None else shard_count
  with_images = vision is not None and vision.enabled
  if with_images and shard_count > 1:
    raise NotImplementedError("a curriculum with images on several hosts: the image-text "
                              "pipeline has no host shard")
  proc = vlm_pipeline.processor_from_config(d, vision, vocab_size) if with_images else None
  tokenizer = proc.tokenizer if with_images else tokenizer_lib.ByteTokenizer()
  tokenizer_lib.check_vocab(tokenizer, vocab_size)
  used = sorted({n for s in plan.stages for n in s.weights})
  train_sources, heldout = {}, []
  for name in used:
    spec = c.sources[name]
    spec = spec.to_dict() if isinstance(spec, ml_collections.ConfigDict) else dict(spec)
    try:
      src = make_source(spec["kind"], spec)
    except ValueError as e:
      raise ValueError(f"curriculum source {name!r} ({spec['kind']}): {e}") from e
    if len(src) < 2:
      raise ValueError(f"curriculum source {name!r} ({spec['kind']}) yields {len(src)} "
                       "documents; it needs at least 2 (one is held out)")
    tr, ho = sources_lib.split_source(src, d.heldout_fraction, d.heldout_seed)
    if len(tr) < shard_count:
      raise ValueError(f"curriculum source {name!r} has {len(tr)} training documents, fewer "
                       f"than the {shard_count} hosts reading it")
    logging.info("curriculum source %s (%s): %d documents, %d train, %d held out", name,
                 spec["kind"], len(src), len(tr), len(ho))
    train_sources[name], heldout = tr, heldout + [ho]
  datas = stage_data(plan, train_sources, seed=t.seed, shard_count=shard_count)
  eval_len = c.eval_seq_len or plan.stages[-1].seq_len
  eval_rows = max(1, plan.tokens_per_step // eval_len)
  evals = pipeline_lib.eval_batches(_ConcatSource(heldout), tokenizer, eval_len, eval_rows,
                                    t.eval_batches)
  if with_images:
    train_img, held_img = vlm_pipeline.image_text_sources(d, vision)
    build = functools.partial(vlm_pipeline.vlm_stage_iterator, proc=proc,
                              image_source=train_img, share=float(d.vision.share))
    held = multimodal.VLMPackedIterator([held_img[i] for i in range(len(held_img))], proc,
                                        seq_len=eval_len, batch_size=eval_rows,
                                        drop_remainder=False)
    evals += list(itertools.islice(held, t.eval_batches))
    logging.info("curriculum with images: %s image-text documents at token share %.2f",
                 d.vision.source, d.vision.share)
  else:
    build = functools.partial(
        stages_lib.make_stage_dataset, tokenizer=tokenizer, shard_index=shard_index,
        shard_count=shard_count, num_packing_bins=c.num_packing_bins,
        num_workers=c.num_workers)
  it = stages_lib.StagedIterator(datas, build)
  return CurriculumData(it, evals, tokenizer, plan,
                        frozenset(s.end_step for s in plan.stages[:-1]))


def describe(plan: Plan) -> str:
  """The plan as a table (one line per stage)."""
  lines = [f"curriculum: {len(plan.stages)} stages, {plan.tokens_per_step:,} tokens/step, "
           f"{plan.total_steps:,} steps, {plan.total_steps * plan.tokens_per_step:,} tokens"]
  for s in plan.stages:
    mix = ", ".join(f"{n} {w:g}" for n, w in s.weights.items())
    extra = f", retrieval {s.retrieval_fraction:g}" if s.retrieval_fraction else ""
    up = f", long x{s.long_upsample} (>= {s.long_min_bytes} B)" if s.long_upsample > 1 else ""
    lr = s.lr
    lines.append(
        f"  {s.index} {s.name}: seq_len {s.seq_len:,} x batch {s.batch_size} | steps "
        f"{s.start_step:,}..{s.end_step:,} | mix {mix}{extra}{up} | lr {lr['lr_from']:.2e} -> "
        f"{lr['lr']:.2e} (warmup {lr['warmup']}) {lr['schedule']}"
        + (f" to x{lr['min_lr_ratio']:g}" if lr["schedule"] != "constant" else ""))
  return "\n".join(lines)
