"""The Pallas KDA kernels inside the model: a packed training step's loss and gradients
with kda impl "pallas" (interpreted on CPU) equal those of the chunked XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")  # pallas_kernels alone needs jax only; the model, flax

from hybridmoe_jax.config import ComputeConfig, KDAConfig, ModelConfig, MoEConfig  # noqa: E402
from hybridmoe_jax.model import HybridLM  # noqa: E402
from hybridmoe_jax.ops.cross_entropy import token_nll  # noqa: E402
from hybridmoe_jax.train.step import next_token_targets  # noqa: E402
from tests._support import assert_close  # noqa: E402


def _model(impl: str) -> HybridLM:
  """A tiny HybridLM (KDA then MLA, grouped KDA heads) whose KDA layers use `impl`; the
  parameters do not depend on impl."""
  kda = KDAConfig(num_heads=1, num_v_heads=2, head_dim=16, v_head_dim=16)
  moe = MoEConfig(num_experts=4, expert_intermediate=32, shared_intermediate=32,
                  dense_intermediate=64)
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, layer_kinds=("kda", "mla"),
                    kda=kda, moe=moe)
  return HybridLM(cfg, rngs=nnx.Rngs(0), compute=ComputeConfig(kda_impl=impl, kda_chunk_size=16))


def _packed_batch():
  """Two rows of 80 tokens; documents start at chunk boundaries (16, 32) and inside chunks,
  one is a single token; segment id 0 is padding (the tail of row 1)."""
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 80), 1, 64)
  seg = np.ones((2, 80), np.int32)
  seg[0, 16:], seg[0, 32:], seg[0, 37:], seg[0, 38:], seg[0, 61:] = 2, 3, 4, 5, 6
  seg[1, 9:], seg[1, 50:], seg[1, 72:] = 2, 3, 0
  return tokens, jnp.asarray(seg)


def _loss_and_grads(impl: str):
  """Mean next-token NLL over same-document targets (train/step.py's definition) and its
  gradients w.r.t. every parameter."""
  graphdef, params, rest = nnx.split(_model(impl), nnx.Param, ...)
  tokens, seg = _packed_batch()

  def loss(params):
    logits, _ = nnx.merge(graphdef, params, rest)(tokens, segment_ids=seg)
    targets, weights = next_token_targets(tokens, seg)
    return jnp.sum(token_nll(logits, targets) * weights) / jnp.sum(weights)

  return jax.jit(jax.value_and_grad(loss))(params)


def test_packed_train_step_pallas_matches_chunked():
  loss, grads = _loss_and_grads("pallas")
  loss_ref, grads_ref = _loss_and_grads("chunked")
  assert np.isfinite(float(loss))
  assert_close(loss, loss_ref, 1e-6, "loss")
  flat = jax.tree_util.tree_leaves_with_path(grads)
  flat_ref = jax.tree_util.tree_leaves(grads_ref)
  assert len(flat) == len(flat_ref)
  for (path, d), d_ref in zip(flat, flat_ref):
    assert_close(d, d_ref, 1e-5, jax.tree_util.keystr(path))
  # The KDA layer's (layer 0's mixer) parameters get gradients through the kernel's backward.
  kda_grads = [d for path, d in flat if jax.tree_util.keystr(path).startswith(
      "['layers'][0]['mixer']")]
  assert len(kda_grads) == 14 and all(float(jnp.abs(d).max()) > 0 for d in kda_grads)
