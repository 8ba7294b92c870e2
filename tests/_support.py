"""Shared test support: error measures and closeness checks; small safetensors files written
and read whole; the tiny models and runs (the
one place they are defined: `tiny_model_config` / `tiny_model` for the configs/tiny.py
hybrid, `mini_model_config` / `set_tiny_model` / `tiny_run_config` for the 2-layer MLA-only
model the training tests run); the RL trajectory log read back and printed as a transcript
(`read_trajectories`, `format_record`); a repository file outside the package (a benchmark, a
config) imported by path (`load_file_module`).

Every measure takes (got, want): the value under test first, the reference second. The
reference is the denominator, so the order matters.
"""

import functools
import importlib.util
import json
import pathlib

import numpy as np

from hybridmoe_jax.config import (ComputeConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig,
                                  model_config_from_dict)
from hybridmoe_jax.io import safetensors


def rel_err(got, want) -> float:
  """max |got - want| / max |want|, in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def rel_rms(got, want) -> float:
  """rms(got - want) / rms(want), in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2)) / (np.sqrt(np.mean(want ** 2)) + 1e-30))


def assert_close(got, want, rtol, what="", *, atol=1e-6):
  """fla's convention: got is finite and max abs error <= atol, or relative RMS error < rtol."""
  assert np.isfinite(np.asarray(got, np.float32)).all(), f"{what}: not finite"
  err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
  rel = rel_rms(got, want)
  assert err <= atol or rel < rtol, f"{what}: max abs {err}, rel rms {rel} (tol {rtol})"


def save_safetensors(path, tensors: dict, *, metadata: dict[str, str] | None = None) -> None:
  """Write a dict of in-memory arrays as one safetensors file (the package streams its writes:
  io.safetensors.SafetensorsWriter)."""
  arrays = {k: np.asarray(v) for k, v in tensors.items()}
  w = safetensors.SafetensorsWriter(
      path, [safetensors.Spec(k, safetensors.dtype_code(a.dtype), a.shape)
             for k, a in arrays.items()], metadata=metadata)
  for k, a in arrays.items():
    w.write(k, [a])
  w.close()


def load_safetensors(path) -> dict:
  """Every tensor of one safetensors file, in memory: {name: np.ndarray}."""
  with safetensors.SafetensorsFile(path) as f:
    return {name: f.read(name) for name in f.tensors}


def tiny_model_config(**overrides) -> ModelConfig:
  """configs/tiny.py's model (3 KDA + 1 MLA, AttnRes, MoE) with `overrides` of its model
  section (a nested section given as a dict is merged into the preset's)."""
  # Imported here: conftest sets the 8-device XLA_FLAGS, which CLI subprocesses that load
  # the mini model through tests/faults/fault_config.py must not inherit.
  from tests.conftest import load_config  # pylint: disable=g-import-not-at-top
  model = load_config("tiny").model
  model.update(overrides)
  return model_config_from_dict(model)


# A 2-layer HybridLM (dense FFN, then MoE; d_model 16, 4 experts top-1). MLA mixers only:
# a KDA layer would add ~10 s to every compile (KDA runs in the tiny-config tests).
MINI_MODEL = dict(d_model=16, num_layers=2, layer_kinds=("mla", "mla"))
MINI_KDA = dict(num_heads=1, num_v_heads=1, head_dim=8, v_head_dim=8)
MINI_MLA = dict(num_heads=1, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8)
MINI_MOE = dict(num_experts=4, experts_per_token=1, expert_intermediate=16,
                shared_intermediate=16, dense_intermediate=32, qb_num_bins=64)


def mini_model_config(vocab_size: int = 64, **moe) -> ModelConfig:
  """The 2-layer MLA-only model (MINI_*) as a ModelConfig; `moe` overrides MoEConfig fields."""
  return ModelConfig(vocab_size=vocab_size, **MINI_MODEL, kda=KDAConfig(**MINI_KDA),
                     mla=MLAConfig(**MINI_MLA), moe=MoEConfig(**{**MINI_MOE, **moe}))


# tiny_model(layer_kinds=TWO_LAYERS): the tiny hybrid cut to one layer of each kind.
TWO_LAYERS = ("kda", "mla")


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0, *, layer_kinds: tuple[str, ...] | None = None,
               compute: ComputeConfig | None = None):
  """The tiny hybrid (3 KDA + 1 MLA, AttnRes, MoE), fp32, built once per argument set (tests
  must not change it). layer_kinds: a cut of it, e.g. ("kda", "mla"): one KDA layer (dense
  FFN) and one MLA layer (MoE), every kind of layer at half the compile and init time, for
  tests whose claim does not depend on the depth. compute: None for the default."""
  # pylint: disable=g-import-not-at-top (flax loads only for the tests that build a model)
  from flax import nnx
  from hybridmoe_jax.model import HybridLM
  cfg = tiny_model_config(**({} if layer_kinds is None else
                             dict(num_layers=len(layer_kinds), layer_kinds=layer_kinds)))
  extra = {} if compute is None else dict(compute=compute)
  return HybridLM(cfg, rngs=nnx.Rngs(seed), **extra)


def set_tiny_model(config) -> None:
  """Write the 2-layer MLA-only model (MINI_*) into a root ConfigDict's `model` section (for
  the loop tests); the vocabulary stays the caller's."""
  m = config.model
  m.update(MINI_MODEL)
  m.kda.update(MINI_KDA)
  m.mla.update(MINI_MLA)
  m.moe.update(MINI_MOE)
  config.compute.kda_chunk_size = 16


# The fault trials' checkpoints: every 2 steps, none rotated away, no evals or heatmaps.
TRIAL_CHECKPOINTS = dict(checkpoint_every=2, keep_checkpoints=1000, heatmap_every=0,
                         eval_every=0)


def tiny_run_config(*, trial: bool = False, **train):
  """The default run config on the 2-layer model: 8 short steps that log, evaluate,
  checkpoint and export often; trial=True: TRIAL_CHECKPOINTS (the fault trials' run);
  `train` overrides config.train fields."""
  from hybridmoe_jax.config.run import default_config  # pylint: disable=g-import-not-at-top
  config = default_config()
  set_tiny_model(config)
  config.model.vocab_size = 64
  config.train.update({**dict(steps=8, batch_size=4, seq_len=16, lr=3e-2, warmup=2,
                              log_every=1, eval_every=4, eval_batches=2, checkpoint_every=3,
                              keep_checkpoints=5, heatmap_every=4, maxvio_alert_steps=3,
                              maxvio_alert_threshold=0.0, async_checkpoints=True),
                       **(TRIAL_CHECKPOINTS if trial else {}), **train})
  return config


def group_specs(env: str, seeds, level: int, group_size: int, *, sample_seed: int = 0,
                first_group: int = 0, forced: tuple = (), env_kwargs: tuple = ()):
  """group_size rl EpisodeSpecs per task seed (one group each), with distinct sample seeds:
  episode j of group g gets sample_seed + g * group_size + j (mod 2**32)."""
  from hybridmoe_jax.rl.episode import EpisodeSpec  # lazily: only the rl tests need rl
  return [EpisodeSpec(env, int(seed), int(level), first_group + g,
                      (sample_seed + (first_group + g) * group_size + j) % 2**32, forced,
                      env_kwargs)
          for g, seed in enumerate(seeds) for j in range(group_size)]


def read_trajectories(path: str) -> list[dict]:
  """The records of a JSONL file written by `rl.trajectory_log.write_trajectories` (a cut
  last line, from a run killed mid-write, is skipped)."""
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out


def format_record(record: dict, *, max_chars: int = 300) -> str:
  """A record as a transcript: one header line, then one line per turn (texts cut to
  max_chars, newlines shown as \\n)."""
  r = record
  lines = [f"{r['env']} level {r['level']} seed {r['seed']}: reward {r['reward']:g} "
           f"({r['finish_reason']}), {r['num_turns']} turns, {r['generated_tokens']} "
           f"generated / {r['total_tokens']} tokens"]
  for t in r["turns"]:
    text = t["text"].replace("\n", "\\n")
    if len(text) > max_chars:
      text = text[:max_chars] + "..."
    extra = ""
    if t["role"] == "assistant":
      lp = "-" if t["mean_logp"] is None else f"{t['mean_logp']:.2f}"
      forced = f", {t['forced_tokens']} forced" if t["forced_tokens"] else ""
      extra = f"   [{t['action']}, {t['tokens']} tokens{forced}, mean logp {lp}]"
    lines.append(f"  {t['role']:>11}: {text}{extra}")
  return "\n".join(lines)


def load_file_module(relpath: str, name: str | None = None):
  """The module at `relpath` (from the repository root, e.g. "benchmarks/mqar_arch.py")
  imported by path: benchmarks/ and configs/ are not packages."""
  path = pathlib.Path(__file__).resolve().parents[1] / relpath
  spec = importlib.util.spec_from_file_location(name or "_" + path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
