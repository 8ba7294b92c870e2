"""The typed run config: every section of a training run as a frozen, validated dataclass.

`run_config_from_dict(config)` turns the root ConfigDict of a `configs/*.py` preset (with
its `--config.x.y=` overrides) into a `RunConfig` once, at the CLI boundary; everything
below takes these objects. Defaults and allowed ranges are written once, here (`ranged`;
the ConfigDict a preset starts from is built from them: `default_config`); the checks
across fields are each class's `check`, those across sections (the curriculum against the
model, compute and train sections; the vision data against the tower) `RunConfig.check`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import ml_collections

from hybridmoe_jax.config import (Allowed, Checked, ComputeConfig, ModelConfig, VisionConfig,
                                  from_dict, ranged, require)
from hybridmoe_jax.config.hardware import HardwareConfig
from hybridmoe_jax.config.rl import RLConfig

SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
DATA_SOURCES = ("bundled", "text", "jsonl", "arrayrecord", "parquet")
BAD_RECORD_MODES = ("skip", "error")  # data.bad_records (data/sources.py: BadRecords)
VISION_SOURCES = ("synthetic", "jsonl")
CURRICULUM_SOURCES = ("bundled", "stdlib_long", "text", "jsonl", "arrayrecord", "parquet")
STAGE_SCHEDULES = ("constant", "cosine", "linear", "wsd")
# Synthetic Q/A scene documents (data/images.py): question types and their default relative
# sampling weights; digit identity at a position is the hardest type (10 classes read from
# a few pixels after a 2-D position lookup), so it is asked twice as often.
QUESTION_TYPES = ("count", "where", "colour")
QA_WEIGHTS = {"count": 1.0, "where": 2.0, "colour": 1.0}


def _profile_window(spec) -> tuple[int, int] | None:
  parts = spec.split(":") if isinstance(spec, str) else []
  if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
    first, last = int(parts[0]), int(parts[1])
    if 1 <= first <= last:
      return first, last
  return None


PROFILE_STEPS = Allowed(lambda s: s == "" or _profile_window(s) is not None,
                        "'' (off) or 'A:B': steps A..B to trace, integers with 1 <= A <= B")
# Non-empty path strings; for a source that reads files, at least one (the class's check).
PATHS = Allowed(lambda ps: all(isinstance(p, str) and p for p in ps),
                "a tuple of non-empty path strings")


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
  """`train.profile_steps`: "" -> None (off); "A:B" -> (A, B) with 1 <= A <= B.

  Raises:
    ConfigError: any other string.
  """
  require(PROFILE_STEPS.ok(spec), "train.profile_steps", spec, PROFILE_STEPS.text)
  return _profile_window(spec)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Checked):
  """The `train` section: optimisation, evaluation, checkpoints and alerts."""

  PATH = "train"
  steps: int = ranged(300, ">= 1")           # optimizer steps (one global batch each)
  # sequences per optimizer step (split into grad_accum parts)
  batch_size: int = ranged(8, ">= 1")
  seq_len: int = ranged(256, ">= 2")         # tokens per packed sequence
  lr: float = ranged(3e-3, "(0, 10]")        # peak learning rate
  # linear warmup steps from 0 to lr (capped at steps)
  warmup: int = ranged(30, ">= 0")
  # "cosine" (to min_lr_ratio * lr), "wsd" or "constant"
  schedule: str = ranged("cosine", SCHEDULES)
  min_lr_ratio: float = ranged(0.1, "[0, 1]")    # final learning rate / lr (cosine and wsd)
  decay_fraction: float = ranged(0.2, "[0, 1]")  # share of the steps in the final decay of wsd
  # "adamw" or "muon" (train/muon.py; AdamW for embeddings, the head and vectors)
  optimizer: str = ranged("adamw", OPTIMIZERS)
  b1: float = ranged(0.9, "[0, 1)")          # Adam moments
  b2: float = ranged(0.95, "[0, 1)")
  # decoupled, on matrices only (not norms, gains, biases)
  weight_decay: float = ranged(0.1, "[0, 10]")
  # global-norm gradient clipping threshold
  clip: float = ranged(1.0, ">= 0", "0 disables clipping")
  grad_accum: int = ranged(1, ">= 1")        # microbatches per step (divides batch_size)
  log_every: int = ranged(10, ">= 1")        # progress line / TensorBoard / JSONL every N steps
  # held-out evaluation every N steps (and at the end)
  eval_every: int = ranged(100, ">= 0", "0: only at the end")
  eval_batches: int = ranged(8, ">= 1")      # batches per evaluation
  # checkpoint every N steps (and at the end / on SIGINT)
  checkpoint_every: int = ranged(100, ">= 0", "0: only at the end")
  keep_checkpoints: int = ranged(3, ">= 1")  # checkpoints kept in workdir/checkpoints
  async_checkpoints: bool = True  # write checkpoints in a background thread
  # Where checkpoints go instead of workdir/checkpoints, e.g. gs://bucket/run/ckpt (logs and
  # the run lock stay in the local workdir, which records this location for later readers).
  checkpoint_dir: str = ranged("", Allowed(lambda v: isinstance(v, str) and v.strip() == v,
                                           "'' or a directory / gs:// path"))
  seed: int = ranged(0, ">= 0")              # parameter init and the training RNG
  # Alert when a layer's MaxVio stays above the threshold for maxvio_alert_steps steps.
  maxvio_alert_threshold: float = ranged(0.5, ">= 0")
  maxvio_alert_steps: int = ranged(50, ">= 1")
  # alert when the loss exceeds this x its running mean
  loss_spike_factor: float = ranged(1.5, ">= 1")
  # expert-load heatmap PNG every N steps (and at the end)
  heatmap_every: int = ranged(50, ">= 0", "0: off")
  # A run whose updates are skipped (non-finite loss, gradient or update) this many steps in
  # a row has diverged: it stops with an error and saves nothing (the last good checkpoint
  # stays the newest).
  max_consecutive_skips: int = ranged(10, ">= 1")
  # another host's workdir lock without a heartbeat this long: stale
  lock_stale_s: float = ranged(600.0, ">= 60", "seconds: two missed heartbeats at the least")
  # "A:B": jax.profiler trace of steps A..B in workdir/profile
  profile_steps: str = ranged("", PROFILE_STEPS)
  # A resume with another tokenizer than the checkpoints' (workdir/inputs.json) is refused
  # unless this is set (train/run_inputs.py).
  allow_tokenizer_change: bool = False

  def check(self, p: str) -> None:
    require(self.batch_size % self.grad_accum == 0, f"{p}.grad_accum", self.grad_accum,
            f"a divisor of batch_size={self.batch_size}")


@dataclasses.dataclass(frozen=True)
class VisionDataConfig(Checked):
  """`data.vision`: image-text documents of a vision model (used when model.vision.enabled)."""

  PATH = "data.vision"
  share: float = ranged(0.5, "(0, 1]")  # share of training tokens from image-text documents
  # "synthetic" (generated digit scenes with Q/A) or "jsonl"
  source: str = ranged("synthetic", VISION_SOURCES)
  paths: tuple[str, ...] = ranged((), PATHS)   # JSONL files or directories for source = "jsonl"
  num_train: int = ranged(200000, ">= 1")   # generated documents per epoch (synthetic)
  num_heldout: int = ranged(64, ">= 1")     # generated held-out documents
  # generated image sides (multiples of 2 * patch_size: RunConfig.check; >= 10 pixels: each
  # of a scene's 2x2 cells holds a glyph 5 pixels tall, data/images.py)
  sides: tuple[int, ...] = ranged((28, 56), ">= 10", "pixels", nonempty=True)
  # seeds of the generated train and held-out scenes
  train_seed: int = ranged(1, ">= 0")
  heldout_seed: int = ranged(2, ">= 0")
  pad_images: bool = False      # pad sides that are not multiples of 2 * patch_size
  # Target weights in documents that mark answer spans (the synthetic Q/A documents; JSONL
  # records with "answer_spans"); every other token weighs 1. Standard prompt masking is
  # (0, 1); configs/tiny_vlm.py weighs answers up.
  prompt_loss_weight: float = ranged(0.0, "[0, 1]")
  answer_loss_weight: float = ranged(1.0, "(0, 100]")
  # Synthetic Q/A documents: relative sampling weight of each question type.
  question_weights: dict[str, float] = ranged(QA_WEIGHTS, Allowed(
      lambda qw: sorted(qw) == sorted(QUESTION_TYPES) and all(w > 0 for w in qw.values()),
      f"a weight > 0 for each of {QUESTION_TYPES}"))

  def check(self, p: str) -> None:
    require(self.source != "jsonl" or len(self.paths) > 0, f"{p}.paths", self.paths,
            "at least one path when source = 'jsonl'")
    # The held-out scenes are apart from the training ones only by their seed.
    require(self.source != "synthetic" or self.heldout_seed != self.train_seed,
            f"{p}.heldout_seed", self.heldout_seed,
            f"a seed other than train_seed={self.train_seed} (the held-out scenes would be "
            "the training scenes)")

  def check_against(self, vision: VisionConfig) -> None:
    """The generated sides must suit the tower (multiples of 2 * patch_size, in a bucket)."""
    m, top = 2 * vision.patch_size, vision.image_buckets[-1]
    require(all(s <= top and s % m == 0 for s in self.sides), "data.vision.sides", self.sides,
            f"positive multiples of 2 * patch_size = {m}, at most the largest bucket {top}")


@dataclasses.dataclass(frozen=True)
class DataConfig(Checked):
  """`data`: where documents come from. Sizes that change between curriculum stages
  (seq_len, batch size) and the run seed are pipeline arguments, not fields here."""

  PATH = "data"
  # "bundled" (pydoc_data help texts), "text", "jsonl", "arrayrecord" (text records, or
  # token shards from `python -m hybridmoe_jax.data.prepare`) or "parquet"
  source: str = ranged("bundled", DATA_SOURCES)
  # files, directories (searched recursively) or globs; gs:// for arrayrecord / parquet
  paths: tuple[str, ...] = ranged((), PATHS)
  # JSON key (jsonl) or column (parquet) holding a document's text
  jsonl_field: str = ranged("text", Allowed(bool, "a non-empty string"))
  # share of documents held out (at least one document)
  heldout_fraction: float = ranged(0.05, "(0, 0.5]")
  # Seed of the train / held-out split; apart from the run seed so that runs with other
  # seeds are evaluated on the same documents.
  heldout_seed: int = ranged(0, ">= 0")
  shuffle: bool = True          # shuffle documents (every epoch anew); False: source order
  num_packing_bins: int = ranged(16, ">= 1")  # rows the first-fit packer fills at once
  # Input shards the global batch is cut into (each its own documents and packer); each
  # process reads input_shards / process_count of them, so a fixed value gives the same
  # global batches on 1, 2, ... processes (a divisor of it); curriculum stages too (each
  # stage's batch split the same way). 0: one shard per process.
  input_shards: int = ranged(0, ">= 0")
  # A bad record (JSONL line that is not a JSON object with a non-empty, UTF-8-encodable
  # string text; a text file that is not UTF-8 or empty): "skip" leaves it out with one
  # counted warning per file, "error" stops before training naming file and line.
  bad_records: str = ranged("skip", BAD_RECORD_MODES)
  # "byte" (UTF-8 bytes, 259 ids; 262 with vision), or a path to a Hugging Face
  # tokenizer.json, a tiktoken BPE file (Kimi's tiktoken.model) or a directory holding one;
  # the run copies it to <workdir>/tokenizer/ (data/tokenizers/load.py).
  # The file itself is read (and checked) when the run builds its data: a saved config
  # must stay valid where the file is gone.
  tokenizer: str = ranged("byte", Allowed(
      lambda t: isinstance(t, str) and t.strip() == t != "",
      "'byte', 'byte_chat' or a path to a tokenizer.json, a tiktoken model file, or a "
      "directory holding one"))
  vision: VisionDataConfig = VisionDataConfig()

  def check(self, p: str) -> None:
    require(self.source == "bundled" or len(self.paths) > 0, f"{p}.paths", self.paths,
            f"at least one file or directory when data.source = {self.source!r}")


# A mesh axis size: -1 takes the remaining devices.
AXIS_SIZE = Allowed(
    lambda v: isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v == -1),
    "an integer >= 1, or -1 for the remaining devices")


@dataclasses.dataclass(frozen=True)
class MeshConfig(Checked):
  """`mesh`: axis sizes; -1 takes the remaining devices; the product must equal the number
  of devices of all processes. Batch over data x fsdp, experts over expert (parallel/rules),
  each sequence over context (parallel/context.py); context_zigzag: each context shard holds
  two pieces of the sequence, r and 2n-1-r of 2n (balanced causal work), instead of one."""

  PATH = "mesh"
  data: int = ranged(1, AXIS_SIZE)
  fsdp: int = ranged(-1, AXIS_SIZE)
  expert: int = ranged(1, AXIS_SIZE)
  tensor: int = ranged(1, AXIS_SIZE)
  context: int = ranged(1, AXIS_SIZE)
  context_zigzag: bool = False

  def axis_sizes(self) -> dict[str, int]:
    """{axis: size} of the mesh axes (without the layout flag)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "context_zigzag"}

  def check(self, p: str) -> None:
    sizes = self.axis_sizes()
    require(list(sizes.values()).count(-1) <= 1, p, sizes, "at most one axis of size -1")
    require(not self.context_zigzag or self.context != 1, f"{p}.context_zigzag",
            self.context_zigzag, "False unless mesh.context > 1 (zigzag lays out the "
            "sequence over several context shards)")


@dataclasses.dataclass(frozen=True)
class SourceConfig(Checked):
  """A named curriculum document source: kind "bundled" (pydoc help texts), "stdlib_long"
  (standard-library sources per package, data/long_docs.py; paths[0]: another root),
  "text" or "jsonl" (paths; `field` is the JSON text key)."""

  kind: str = ranged("", CURRICULUM_SOURCES)
  paths: tuple[str, ...] = ranged((), PATHS)
  field: str = "text"

  def check(self, p: str) -> None:
    require(self.kind not in ("text", "jsonl") or len(self.paths) > 0, f"{p}.paths",
            self.paths, f"at least one path for kind {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class StageConfig(Checked):
  """One curriculum stage as written (resolved by `train/stage_plan.py: build_plan`).

  seq_len: tokens per row (a multiple of compute.kda_chunk_size); steps | tokens: the stage
  length in optimizer steps or in tokens (exactly one); weights: {source name: weight};
  long_upsample: documents of >= long_min_tokens bytes (0: seq_len // 2) appear this many
  times per epoch; retrieval_fraction: share of synthetic passkey / key-value documents;
  retrieval_answer_weight: loss weight of their answer tokens (the key after a question, the
  recalled values; other tokens weigh 1); retrieval_kinds: which retrieval documents
  (`data.retrieval.KINDS`; e.g. passkey alone, the easiest copy, in a first stage);
  retrieval_bytes: (shortest, longest) retrieval document in bytes, each drawn uniformly
  between (0: the default, a quarter of the row but >= 128, and the row): short documents
  put many answers in a step, which is what makes a small model learn the copy;
  lr (None: train.lr), warmup, warmup_from (None: where the previous stage ended),
  schedule, min_lr_ratio, decay_fraction: the stage's learning rate;
  tokens_per_step: this stage's global tokens per optimizer step (0: the curriculum's), for
  stages whose one sequence holds more than the curriculum's step (e.g. 32K rows on an 8K
  budget).
  """

  name: str = ""
  seq_len: int | None = ranged(None, ">= 2")
  steps: int = ranged(0, ">= 0")
  tokens: int = ranged(0, ">= 0")
  tokens_per_step: int = ranged(0, ">= 0", "0: curriculum.tokens_per_step")
  weights: dict[str, float] | None = ranged(None, ">= 0")
  long_upsample: int = ranged(1, ">= 1")
  long_min_tokens: int = ranged(0, ">= 0", "0: seq_len // 2")
  retrieval_fraction: float = ranged(0.0, "[0, 0.9]")
  retrieval_answer_weight: float = ranged(1.0, "[1, 100]", "1: answers weigh like other tokens")
  retrieval_kinds: tuple[str, ...] = ranged(("passkey", "multikey", "kv"),
                                            ("passkey", "multikey", "kv", "textkey",
                                             "textchain", "mixkey"), nonempty=True)
  retrieval_bytes: tuple[int, int] = ranged((0, 0), ">= 0", "0: the default bound")
  lr: float | None = ranged(None, "(0, 10]", "None: train.lr")
  warmup: int = ranged(0, ">= 0")
  warmup_from: float | None = ranged(None, "[0, 10]",
                                     "None: continue from the previous stage")
  schedule: str = ranged("constant", STAGE_SCHEDULES)
  min_lr_ratio: float = ranged(1.0, "[0, 1]")
  decay_fraction: float = ranged(0.2, "[0, 1]")

  def check(self, p: str) -> None:
    require(self.seq_len is not None, f"{p}.seq_len", None, "an integer >= 2")
    require((self.steps > 0) != (self.tokens > 0), f"{p}.steps/tokens",
            (self.steps, self.tokens), "exactly one of `steps` or `tokens` > 0")
    require(bool(self.weights) and sum(self.weights.values()) > 0, f"{p}.weights",
            self.weights, "a dict {source name: weight} with at least one weight > 0")
    require(not self.retrieval_fraction or self.seq_len >= 64, f"{p}.retrieval_fraction",
            self.retrieval_fraction, "0 for stages shorter than 64 tokens")
    lo, hi = self.retrieval_bytes if len(self.retrieval_bytes) == 2 else (-1, -1)
    require(0 <= hi <= self.seq_len - 2 and (not lo or 64 <= lo <= (hi or self.seq_len - 2)),
            f"{p}.retrieval_bytes", self.retrieval_bytes,
            f"(shortest, longest) with 64 <= shortest <= longest <= seq_len - 2 = "
            f"{self.seq_len - 2} (0: the default)")


@dataclasses.dataclass(frozen=True)
class CurriculumConfig(Checked):
  """`curriculum`: the staged context curriculum (no stages: a plain run, train/stage_plan.py)."""

  PATH = "curriculum"
  # global tokens per optimizer step (a stage may raise it); >= 2 with stages
  tokens_per_step: int = ranged(0, ">= 0")
  stages: tuple[StageConfig, ...] = ()  # ordered stages of increasing seq_len
  # Passkey needle-in-a-haystack grid after every stage (run_train.py; empty: none):
  # context lengths, needle depths and prompts per cell.
  niah_lengths: tuple[int, ...] = ranged((), ">= 64", "tokens; empty: no NIAH grid")
  niah_depths: tuple[float, ...] = ranged((0.1, 0.5, 0.9), "[0, 1]", nonempty=True)
  niah_samples: int = ranged(2, ">= 1")
  # > 0: after a stage, only lengths <= factor x its seq_len
  niah_max_factor: float = ranged(0.0, ">= 0", "0: every NIAH length after every stage")
  sources: dict[str, SourceConfig] = dataclasses.field(default_factory=dict)
  # grain worker processes per host; 0 packs in a thread
  num_workers: int = ranged(0, ">= 0")
  num_packing_bins: int = ranged(16, ">= 1")  # rows the first-fit packer fills at once
  eval_seq_len: int = ranged(0, ">= 0", "0: the longest stage")  # held-out sequence length

  @property
  def enabled(self) -> bool:
    return bool(self.stages)

  def sizes(self, st: StageConfig) -> tuple[int, int]:
    """(global tokens per optimizer step, optimizer steps) of the stage `st`."""
    tps = st.tokens_per_step or self.tokens_per_step
    return tps, st.steps or st.tokens // tps

  def check(self, p: str) -> None:
    if not self.stages:
      return
    require(self.tokens_per_step >= 2, f"{p}.tokens_per_step", self.tokens_per_step,
            "an integer >= 2 when curriculum.stages is set")
    names = sorted(self.sources)
    require(bool(names), f"{p}.sources", {}, "at least one named source")
    prev_len = 0
    for k, st in enumerate(self.stages):
      w, T, (tps, steps) = f"{p}.stages[{k}]", st.seq_len, self.sizes(st)
      where = (f"{w}.tokens_per_step={tps}" if st.tokens_per_step
               else f"curriculum.tokens_per_step={tps}")
      require(T > prev_len, f"{w}.seq_len", T,
              f"a length > the previous stage's {prev_len} (stage lengths must increase)")
      require(tps % T == 0, f"{w}.seq_len", T,
              f"a divisor of {where} (batch = tokens_per_step / seq_len)")
      require(st.tokens % tps == 0, f"{w}.tokens", st.tokens, f"a multiple of {where}")
      bad = sorted(set(st.weights) - set(names))
      require(not bad, f"{w}.weights", bad, f"source names among {names}")
      require(st.warmup <= steps, f"{w}.warmup", st.warmup, f"an integer in [0, steps={steps}]")
      prev_len = T


@dataclasses.dataclass(frozen=True)
class RunConfig(Checked):
  """The whole run: what the model is, how it computes, and how it is trained and fed."""

  PATH = ""
  model: ModelConfig = ModelConfig()
  compute: ComputeConfig = ComputeConfig()
  train: TrainConfig = TrainConfig()
  data: DataConfig = DataConfig()
  mesh: MeshConfig = MeshConfig()
  curriculum: CurriculumConfig = CurriculumConfig()
  hardware: HardwareConfig = HardwareConfig()
  rl: RLConfig = RLConfig()     # agentic RL post-training (rl_config.py); no envs: off

  def check(self, p: str) -> None:
    """The sections against each other: the vision data against the tower, the curriculum
    stages against the KDA chunk, train.grad_accum and train.steps."""
    if self.model.vision.enabled:
      self.data.vision.check_against(self.model.vision)
    c, t, chunk = self.curriculum, self.train, self.compute.kda_chunk_size
    total = 0
    for k, st in enumerate(c.stages):
      w, T, (tps, steps) = f"curriculum.stages[{k}]", st.seq_len, c.sizes(st)
      require("kda" not in self.model.layer_kinds or T % chunk == 0, f"{w}.seq_len", T,
              f"a multiple of the KDA chunk size compute.kda_chunk_size={chunk}")
      require(tps // T % t.grad_accum == 0, f"{w}.seq_len", T, f"a length whose batch "
              f"{tps // T} is a multiple of train.grad_accum={t.grad_accum}")
      # The image-text packer (data/vlm_pipeline.py) keeps a text document's tokens, not the
      # retrieval answers' loss weights: refused rather than trained unweighted.
      require(not self.model.vision.enabled or not st.retrieval_fraction
              or st.retrieval_answer_weight == 1, f"{w}.retrieval_answer_weight",
              st.retrieval_answer_weight, "1 in a vision model's curriculum (answer weights "
              "are not implemented in the image-text packer)")
      total += steps
    require(not c.stages or t.steps <= total, "train.steps", t.steps,
            f"at most the curriculum's {total} steps (the sum of the stage lengths)")
    # Rollouts decode whole sequences on one device's cache: no context-parallel RL.
    require(not self.rl.enabled or self.mesh.context == 1, "mesh.context", self.mesh.context,
            "1 for an RL run (rl.envs set): context-parallel RL is not implemented")


def default_config() -> ml_collections.ConfigDict:
  """The root ConfigDict every `configs/*.py` preset starts from: the defaults above."""
  fields = dataclasses.asdict(RunConfig())
  fields["model"]["layer_kinds"] = ()  # () -> the default pattern of whatever num_layers
  return ml_collections.ConfigDict(fields)


def run_config_from_dict(config: Mapping[str, Any] | RunConfig) -> RunConfig:
  """The validated `RunConfig` of a root ConfigDict / dict (a RunConfig passes through).

  Missing sections and fields take their defaults. Raises ConfigError naming the first
  bad field (a field that moved, e.g. model.dtype, names its new place `compute.dtype`).
  """
  if isinstance(config, RunConfig):
    return config
  return from_dict(RunConfig, config)
