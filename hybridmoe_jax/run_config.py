"""The typed run config: every section of a training run as a frozen, validated dataclass.

`run_config_from_dict(config)` turns the root ConfigDict of a `configs/*.py` preset (with
its `--config.x.y=` overrides) into a `RunConfig` once, at the CLI boundary; everything
below takes these objects. Defaults are written once, here (the ConfigDict a preset starts
from is built from them: `train/config.py: default_config`). Ranges are checked in each
`__post_init__`; checks across sections (the curriculum against the model and the train
section) are the plan's (`train/plan.py`), the vision data against the tower's patch size
is `RunConfig`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from hybridmoe_jax.config import (ComputeConfig, ModelConfig, VisionConfig, from_dict,
                                  require)
from hybridmoe_jax.hardware import HardwareConfig
from hybridmoe_jax.rl_config import RLConfig

SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
DATA_SOURCES = ("bundled", "text", "jsonl")
BAD_RECORD_MODES = ("skip", "error")  # data.bad_records (data/sources.py: BadRecords)
VISION_SOURCES = ("synthetic", "jsonl")
CURRICULUM_SOURCES = ("bundled", "stdlib_long", "text", "jsonl")
STAGE_SCHEDULES = ("constant", "cosine", "linear", "wsd")
# Synthetic Q/A scene documents (data/images.py): question types and their default relative
# sampling weights; digit identity at a position is the hardest type (10 classes read from
# a few pixels after a 2-D position lookup), so it is asked twice as often.
QUESTION_TYPES = ("count", "where", "colour")
QA_WEIGHTS = {"count": 1.0, "where": 2.0, "colour": 1.0}


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
  """`train.profile_steps`: "" -> None (off); "A:B" -> (A, B) with 1 <= A <= B.

  Raises:
    ConfigError: any other string.
  """
  if spec == "":
    return None
  parts = spec.split(":") if isinstance(spec, str) else []
  ok = len(parts) == 2 and all(p.strip().isdigit() for p in parts)
  first, last = (int(parts[0]), int(parts[1])) if ok else (0, 0)
  require(ok and 1 <= first <= last, "train.profile_steps", spec,
          "'' (off) or 'A:B': steps A..B to trace, integers with 1 <= A <= B")
  return first, last


def _ints(prefix: str, lo: int, **fields: int) -> None:
  for name, v in fields.items():
    require(v >= lo, f"{prefix}.{name}", v, f"an integer >= {lo}")


def _range(field: str, v: float, lo: float, hi: float, allowed: str) -> None:
  require(lo <= v <= hi, field, v, allowed)


def _paths(field: str, paths: tuple[str, ...]) -> None:
  require(all(p for p in paths), field, paths, "a tuple of non-empty path strings")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The `train` section: optimisation, evaluation, checkpoints and alerts."""

  steps: int = 300              # optimizer steps (one global batch each)
  batch_size: int = 8           # sequences per optimizer step (split into grad_accum parts)
  seq_len: int = 256            # tokens per packed sequence
  lr: float = 3e-3              # peak learning rate
  warmup: int = 30              # linear warmup steps from 0 to lr (capped at steps)
  schedule: str = "cosine"      # "cosine" (to min_lr_ratio * lr), "wsd" or "constant"
  min_lr_ratio: float = 0.1     # final learning rate / lr (cosine and wsd)
  decay_fraction: float = 0.2   # share of the steps in the final decay of wsd
  optimizer: str = "adamw"      # "adamw" or "muon" (optax.contrib; AdamW for non-matrices)
  b1: float = 0.9               # Adam moments
  b2: float = 0.95
  weight_decay: float = 0.1     # decoupled, on matrices only (not norms, gains, biases)
  clip: float = 1.0             # global-norm gradient clipping threshold; 0 disables
  grad_accum: int = 1           # microbatches per step (divides batch_size)
  log_every: int = 10           # progress line / TensorBoard / JSONL every N steps
  eval_every: int = 100         # held-out evaluation every N steps (and at the end); 0: end
  eval_batches: int = 8         # batches per evaluation
  checkpoint_every: int = 100   # checkpoint every N steps (and at the end / on SIGINT); 0: end
  keep_checkpoints: int = 3     # checkpoints kept in workdir/checkpoints
  async_checkpoints: bool = True  # write checkpoints in a background thread
  seed: int = 0                 # parameter init and the training RNG
  # Alert when a layer's MaxVio stays above the threshold for maxvio_alert_steps steps.
  maxvio_alert_threshold: float = 0.5
  maxvio_alert_steps: int = 50
  loss_spike_factor: float = 1.5  # alert when the loss exceeds this x its running mean
  heatmap_every: int = 50       # expert-load heatmap PNG every N steps (and at the end); 0: off
  # A run whose updates are skipped (non-finite loss, gradient or update) this many steps in
  # a row has diverged: it stops with an error and saves nothing (the last good checkpoint
  # stays the newest).
  max_consecutive_skips: int = 10
  lock_stale_s: float = 600.0   # another host's workdir lock without a heartbeat this long: stale
  profile_steps: str = ""       # "A:B": jax.profiler trace of steps A..B in workdir/profile
  # A resume with another tokenizer than the checkpoints' (workdir/inputs.json) is refused
  # unless this is set (train/run_inputs.py).
  allow_tokenizer_change: bool = False

  def __post_init__(self):
    p = "train"
    _ints(p, 1, steps=self.steps, batch_size=self.batch_size, grad_accum=self.grad_accum,
          log_every=self.log_every, keep_checkpoints=self.keep_checkpoints,
          eval_batches=self.eval_batches, maxvio_alert_steps=self.maxvio_alert_steps,
          max_consecutive_skips=self.max_consecutive_skips)
    _ints(p, 2, seq_len=self.seq_len)
    _ints(p, 0, warmup=self.warmup, eval_every=self.eval_every,
          checkpoint_every=self.checkpoint_every, heatmap_every=self.heatmap_every,
          seed=self.seed)
    require(self.batch_size % self.grad_accum == 0, f"{p}.grad_accum", self.grad_accum,
            f"a divisor of batch_size={self.batch_size}")
    _range(f"{p}.lr", self.lr, 1e-12, 10.0, "a float in (0, 10]")
    _range(f"{p}.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0, "a float in [0, 1]")
    _range(f"{p}.decay_fraction", self.decay_fraction, 0.0, 1.0, "a float in [0, 1]")
    _range(f"{p}.b1", self.b1, 0.0, 0.999999, "a float in [0, 1)")
    _range(f"{p}.b2", self.b2, 0.0, 0.999999, "a float in [0, 1)")
    _range(f"{p}.weight_decay", self.weight_decay, 0.0, 10.0, "a float in [0, 10]")
    _range(f"{p}.clip", self.clip, 0.0, math.inf, "a float >= 0 (0 disables clipping)")
    _range(f"{p}.maxvio_alert_threshold", self.maxvio_alert_threshold, 0.0, math.inf,
           "a float >= 0")
    _range(f"{p}.lock_stale_s", self.lock_stale_s, 60.0, math.inf,
           "a number of seconds >= 60 (two missed heartbeats at the least)")
    _range(f"{p}.loss_spike_factor", self.loss_spike_factor, 1.0, math.inf, "a float >= 1")
    require(self.schedule in SCHEDULES, f"{p}.schedule", self.schedule, f"one of {SCHEDULES}")
    parse_profile_steps(self.profile_steps)
    require(self.optimizer in OPTIMIZERS, f"{p}.optimizer", self.optimizer,
            f"one of {OPTIMIZERS}")


def check_loss_weights(prompt: float, answer: float) -> None:
  """ConfigError unless prompt_loss_weight is in [0, 1] and answer_loss_weight in (0, 100]."""
  p = "data.vision"
  _range(f"{p}.prompt_loss_weight", prompt, 0.0, 1.0, "a number in [0, 1]")
  require(0.0 < answer <= 100.0, f"{p}.answer_loss_weight", answer, "a number in (0, 100]")


@dataclasses.dataclass(frozen=True)
class VisionDataConfig:
  """`data.vision`: image-text documents of a vision model (used when model.vision.enabled)."""

  share: float = 0.5            # share of training tokens from image-text documents, (0, 1]
  source: str = "synthetic"     # "synthetic" (generated digit scenes with Q/A) or "jsonl"
  paths: tuple[str, ...] = ()   # JSONL files or directories for source = "jsonl"
  num_train: int = 200000       # generated documents per epoch (synthetic)
  num_heldout: int = 64         # generated held-out documents
  sides: tuple[int, ...] = (28, 56)  # generated image sides (multiples of 2 * patch_size)
  train_seed: int = 1           # seeds of the generated train and held-out scenes
  heldout_seed: int = 2
  pad_images: bool = False      # pad sides that are not multiples of 2 * patch_size
  # Target weights in documents that mark answer spans (the synthetic Q/A documents; JSONL
  # records with "answer_spans"): prompt text in [0, 1], answers in (0, 100]; every other
  # token weighs 1. Standard prompt masking is (0, 1); configs/tiny_vlm.py weighs answers up.
  prompt_loss_weight: float = 0.0
  answer_loss_weight: float = 1.0
  # Synthetic Q/A documents: relative sampling weight of each question type (> 0).
  question_weights: dict[str, float] = dataclasses.field(
      default_factory=lambda: dict(QA_WEIGHTS))

  def __post_init__(self):
    p = "data.vision"
    require(0.0 < self.share <= 1.0, f"{p}.share", self.share, "a number in (0, 1]")
    require(self.source in VISION_SOURCES, f"{p}.source", self.source,
            f"one of {VISION_SOURCES}")
    _paths(f"{p}.paths", self.paths)
    if self.source == "jsonl":
      require(len(self.paths) > 0, f"{p}.paths", self.paths,
              "at least one path when source = 'jsonl'")
    _ints(p, 1, num_train=self.num_train, num_heldout=self.num_heldout)
    check_loss_weights(self.prompt_loss_weight, self.answer_loss_weight)
    qw = self.question_weights
    require(sorted(qw) == sorted(QUESTION_TYPES) and all(w > 0 for w in qw.values()),
            f"{p}.question_weights", qw, f"a weight > 0 for each of {QUESTION_TYPES}")

  def check_against(self, vision: VisionConfig) -> None:
    """The generated sides must suit the tower (multiples of 2 * patch_size, in a bucket)."""
    m, top = 2 * vision.patch_size, vision.image_buckets[-1]
    require(len(self.sides) > 0 and all(0 < s <= top and s % m == 0 for s in self.sides),
            "data.vision.sides", self.sides,
            f"positive multiples of 2 * patch_size = {m}, at most the largest bucket {top}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """`data`: where documents come from. Sizes that change between curriculum stages
  (seq_len, batch size) and the run seed are pipeline arguments, not fields here."""

  source: str = "bundled"       # "bundled" (pydoc_data help texts), "text" or "jsonl"
  paths: tuple[str, ...] = ()   # files or directories for text / jsonl (searched recursively)
  jsonl_field: str = "text"     # JSON key holding a document's text, for jsonl
  heldout_fraction: float = 0.05  # share of documents held out (at least one document)
  # Seed of the train / held-out split; apart from the run seed so that runs with other
  # seeds are evaluated on the same documents.
  heldout_seed: int = 0
  shuffle: bool = True          # shuffle documents (every epoch anew); False: source order
  num_packing_bins: int = 16    # rows the first-fit packer fills at once
  # A bad record (JSONL line that is not a JSON object with a non-empty, UTF-8-encodable
  # string text; a text file that is not UTF-8 or empty): "skip" leaves it out with one
  # counted warning per file, "error" stops before training naming file and line.
  bad_records: str = "skip"
  # "byte" (UTF-8 bytes, 259 ids; 262 with vision), or a path to a Hugging Face
  # tokenizer.json, a tiktoken BPE file (Kimi's tiktoken.model) or a directory holding one;
  # the run copies it to <workdir>/tokenizer/ (data/tokenizer.py, data/hf_tokenizers.py).
  tokenizer: str = "byte"
  vision: VisionDataConfig = VisionDataConfig()

  def __post_init__(self):
    p = "data"
    require(self.source in DATA_SOURCES, f"{p}.source", self.source, f"one of {DATA_SOURCES}")
    _paths(f"{p}.paths", self.paths)
    if self.source != "bundled":
      require(len(self.paths) > 0, f"{p}.paths", self.paths,
              f"at least one file or directory when data.source = {self.source!r}")
    require(bool(self.jsonl_field), f"{p}.jsonl_field", self.jsonl_field, "a non-empty string")
    require(0.0 < self.heldout_fraction <= 0.5, f"{p}.heldout_fraction",
            self.heldout_fraction, "a number in (0, 0.5]")
    _ints(p, 0, heldout_seed=self.heldout_seed)
    _ints(p, 1, num_packing_bins=self.num_packing_bins)
    require(self.bad_records in BAD_RECORD_MODES, f"{p}.bad_records", self.bad_records,
            f"one of {BAD_RECORD_MODES}")
    # The file itself is read (and checked) when the run builds its data: a saved config
    # must stay valid where the file is gone.
    require(isinstance(self.tokenizer, str) and self.tokenizer.strip() == self.tokenizer != "",
            f"{p}.tokenizer", self.tokenizer, "'byte', 'byte_chat' or a path to a tokenizer.json, a "
            "tiktoken model file, or a directory holding one")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """`mesh`: axis sizes; -1 takes the remaining devices; the product must equal the number
  of devices of all processes. Batch over data x fsdp, experts over expert (parallel/rules),
  each sequence over context (parallel/context.py); context_zigzag: each context shard holds
  two pieces of the sequence, r and 2n-1-r of 2n (balanced causal work), instead of one."""

  data: int = 1
  fsdp: int = -1
  expert: int = 1
  tensor: int = 1
  context: int = 1
  context_zigzag: bool = False

  def axis_sizes(self) -> dict[str, int]:
    """{axis: size} of the mesh axes (without the layout flag)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "context_zigzag"}

  def __post_init__(self):
    sizes = self.axis_sizes()
    for axis, v in sizes.items():
      require(v >= 1 or v == -1, f"mesh.{axis}", v,
              "an integer >= 1, or -1 for the remaining devices")
    require(list(sizes.values()).count(-1) <= 1, "mesh", sizes, "at most one axis of size -1")
    require(not self.context_zigzag or self.context != 1, "mesh.context_zigzag",
            self.context_zigzag, "False unless mesh.context > 1 (zigzag lays out the "
            "sequence over several context shards)")


@dataclasses.dataclass(frozen=True)
class SourceConfig:
  """A named curriculum document source: kind "bundled" (pydoc help texts), "stdlib_long"
  (standard-library sources per package, data/long_docs.py; paths[0]: another root),
  "text" or "jsonl" (paths; `field` is the JSON text key)."""

  kind: str = ""
  paths: tuple[str, ...] = ()
  field: str = "text"


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """One curriculum stage as written (resolved by `train/plan.py: build_plan`).

  seq_len: tokens per row (a multiple of compute.kda_chunk_size); steps | tokens: the stage
  length in optimizer steps or in tokens (exactly one); weights: {source name: weight};
  long_upsample: documents of >= long_min_tokens bytes (0: seq_len // 2) appear this many
  times per epoch; retrieval_fraction: share of synthetic passkey / key-value documents;
  lr (None: train.lr), warmup, warmup_from (None: where the previous stage ended),
  schedule, min_lr_ratio, decay_fraction: the stage's learning rate;
  tokens_per_step: this stage's global tokens per optimizer step (0: the curriculum's), for
  stages whose one sequence holds more than the curriculum's step (e.g. 32K rows on an 8K
  budget).
  """

  name: str = ""
  seq_len: int | None = None
  steps: int = 0
  tokens: int = 0
  tokens_per_step: int = 0
  weights: dict[str, float] | None = None
  long_upsample: int = 1
  long_min_tokens: int = 0
  retrieval_fraction: float = 0.0
  lr: float | None = None
  warmup: int = 0
  warmup_from: float | None = None
  schedule: str = "constant"
  min_lr_ratio: float = 1.0
  decay_fraction: float = 0.2


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
  """`curriculum`: the staged context curriculum (no stages: a plain run, see train/plan.py)."""

  tokens_per_step: int = 0      # global tokens per optimizer step (a stage may raise it)
  stages: tuple[StageConfig, ...] = ()  # ordered stages of increasing seq_len
  # Passkey needle-in-a-haystack grid after every stage (run_train.py; empty: none):
  # context lengths, needle depths in [0, 1] and prompts per cell.
  niah_lengths: tuple[int, ...] = ()
  niah_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
  niah_samples: int = 2
  niah_max_factor: float = 0.0  # > 0: after a stage, only lengths <= factor x its seq_len
  sources: dict[str, SourceConfig] = dataclasses.field(default_factory=dict)
  num_workers: int = 0          # grain worker processes per host; 0 packs in a thread
  num_packing_bins: int = 16    # rows the first-fit packer fills at once
  eval_seq_len: int = 0         # held-out sequence length; 0: the longest stage's

  @property
  def enabled(self) -> bool:
    return bool(self.stages)

  def __post_init__(self):
    p = "curriculum"
    _ints(p, 0, num_workers=self.num_workers)
    _ints(p, 1, num_packing_bins=self.num_packing_bins)
    require(self.eval_seq_len >= 0, f"{p}.eval_seq_len", self.eval_seq_len,
            "an integer >= 0 (0: the longest stage)")
    require(all(int(n) >= 64 for n in self.niah_lengths), f"{p}.niah_lengths",
            self.niah_lengths, "context lengths >= 64 tokens (empty: no NIAH grid)")
    require(bool(self.niah_depths) and all(0 <= d <= 1 for d in self.niah_depths),
            f"{p}.niah_depths", self.niah_depths, "one or more needle depths in [0, 1]")
    _ints(p, 1, niah_samples=self.niah_samples)
    require(self.niah_max_factor >= 0, f"{p}.niah_max_factor", self.niah_max_factor,
            "a number >= 0 (0: every NIAH length after every stage)")
    if not self.stages:
      return
    require(self.tokens_per_step >= 2, f"{p}.tokens_per_step", self.tokens_per_step,
            "an integer >= 2 when curriculum.stages is set")
    require(bool(self.sources), f"{p}.sources", {}, "at least one named source")
    for name, s in self.sources.items():
      w = f"{p}.sources.{name}"
      require(s.kind in CURRICULUM_SOURCES, f"{w}.kind", s.kind,
              f"one of {CURRICULUM_SOURCES}")
      _paths(f"{w}.paths", s.paths)
      if s.kind in ("text", "jsonl"):
        require(len(s.paths) > 0, f"{w}.paths", s.paths,
                f"at least one path for kind {s.kind!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The whole run: what the model is, how it computes, and how it is trained and fed."""

  model: ModelConfig = ModelConfig()
  compute: ComputeConfig = ComputeConfig()
  train: TrainConfig = TrainConfig()
  data: DataConfig = DataConfig()
  mesh: MeshConfig = MeshConfig()
  curriculum: CurriculumConfig = CurriculumConfig()
  hardware: HardwareConfig = HardwareConfig()
  rl: RLConfig = RLConfig()     # agentic RL post-training (rl_config.py); no envs: off

  def __post_init__(self):
    if self.model.vision.enabled:
      self.data.vision.check_against(self.model.vision)


def run_config_from_dict(config: Mapping[str, Any] | RunConfig) -> RunConfig:
  """The validated `RunConfig` of a root ConfigDict / dict (a RunConfig passes through).

  Missing sections and fields take their defaults. Raises ConfigError naming the first
  bad field (a field that moved, e.g. model.dtype, names its new place `compute.dtype`).
  """
  if isinstance(config, RunConfig):
    return config
  return from_dict(RunConfig, config)

