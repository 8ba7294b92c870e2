"""Shared test support: error measures and closeness checks; the tiny model configs.

Every measure takes (got, want): the value under test first, the reference second. The
reference is the denominator, so the order matters.
"""

import numpy as np

from hybridmoe_jax.config import (KDAConfig, MLAConfig, ModelConfig, MoEConfig,
                                  model_config_from_dict)


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
