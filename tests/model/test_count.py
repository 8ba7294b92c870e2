"""Parameter counts of the published models (abstract shapes only, nothing allocated)."""

import jax
import pytest
from flax import nnx

from hybridmoe_jax import count_params
from hybridmoe_jax.config import model_config_from_dict
from hybridmoe_jax.model import HybridLM, param_breakdown
from tests.conftest import load_config


def _cfg(name):
  return model_config_from_dict(load_config(name).model)


@pytest.mark.parametrize("name, total, active, tol", [
    ("kimi_k3", 2.78e12, 104.2e9, 0.02),
    ("kimi_linear_48b", 48e9, 3e9, 0.05),
])
def test_published_counts(name, total, active, tol):
  got_total, got_active = count_params(_cfg(name))
  assert abs(got_total / total - 1) < tol, got_total
  assert abs(got_active / active - 1) < tol, got_active


def test_small_is_about_100m():
  total, _ = count_params(_cfg("small"))
  assert 80e6 < total < 130e6, total


def test_tiny_is_well_under_1m_and_matches_real_init():
  cfg = _cfg("tiny")
  total, active = count_params(cfg)
  assert total < 1_000_000 and active < total
  model = HybridLM(cfg, rngs=nnx.Rngs(0))
  real = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert real == total


def test_breakdown_components():
  counts = param_breakdown(_cfg("kimi_k3"))
  assert counts["routed_experts"] > 0.95 * sum(counts.values())
  assert counts["embedding"] == counts["lm_head"] == 163840 * 7168
  for name in ("kda", "mla", "shared_experts", "router_latent", "dense_ffn"):
    assert counts[name] > 0, name
