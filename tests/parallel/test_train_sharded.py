"""Sharded train step == unsharded train step; QB bias from pooled histograms; mesh errors.

The model is a real `MoE` layer between an embedding and a head (one compile is a few
seconds on CPU, unlike the full decoder); the step, the optimizer, the routing-bias update
and the state layout are the production ones.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ConfigError, model_config_from_dict
from hybridmoe_jax.layers.moe import MoE, RoutingBias, update_bias
from hybridmoe_jax.model.balancing import update_routing_biases
from hybridmoe_jax.ops.quantile_balance import bias_from_histogram, qb_range
from hybridmoe_jax.parallel import rules, runtime, shard_state
from hybridmoe_jax.train import optim
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.train.state import ModelFns
from hybridmoe_jax.train.step import make_train_step
from tests.conftest import load_config, rel_rms
from tests.parallel.helpers import make_mesh, mesh_cfg


class _Block(nnx.Module):
  def __init__(self, cfg, rngs):
    self.ffn = MoE(cfg.d_model, cfg.moe, norm_eps=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)


class MoELM(nnx.Module):
  """embed -> x + MoE(x) -> head: the HybridLM call contract with one MoE layer."""

  def __init__(self, cfg, *, rngs, remat="none"):
    del remat
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
    self.layers = nnx.List([_Block(cfg, rngs)])
    self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens, *, segment_ids=None):
    segment_ids = jnp.ones_like(tokens) if segment_ids is None else segment_ids
    x = self.embed(tokens)
    y, stats = self.layers[0].ffn(x, mask=segment_ids > 0)
    return self.lm_head(x + y), {"moe": {"layer_0": stats}}


FNS = ModelFns(lambda cfg, seed, remat: MoELM(cfg, rngs=nnx.Rngs(seed)), update_routing_biases,
               RoutingBias)


def _config():
  c = load_config("tiny")
  c.model.moe.update(num_experts=8, experts_per_token=2, qb_num_bins=128)
  c.train.update(batch_size=4, seq_len=8, lr=1e-2, warmup=0)
  return c


def _batches(n, vocab=259):
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    segs = np.ones((4, 8), np.int32)
    segs[1, 5:] = 0
    out.append({"tokens": rng.integers(0, vocab, (4, 8)).astype(np.int32),
                "segment_ids": segs})
  return out


def test_sharded_train_step_equals_unsharded():
  c = _config()
  cfg = model_config_from_dict(c.model)
  tx = optim.make_optimizer(c.train)
  mesh = make_mesh(data=2, expert=4)
  graphdef, state, shardings = shard_state.create_sharded_train_state(FNS, cfg, tx, 0, "none",
                                                                      mesh)
  # The reference: the same values on one device, the plain (unsharded) step.
  ref = jax.device_put(jax.device_get(state), jax.devices()[0])
  ref_step = make_train_step(graphdef, FNS, cfg, c.train, tx)
  # Expert weights and their Adam moments live on the expert axis, the bias is replicated.
  ffn = state.params["layers"][0]["ffn"]
  assert ffn["w_gate"][...].sharding.spec[0] == "expert"
  mu = state.opt_state[1][0].mu["layers"][0]["ffn"]["w_gate"][...]
  assert mu.sharding.spec == ffn["w_gate"][...].sharding.spec
  assert state.biases["layers"][0]["ffn"]["bias"][...].sharding.is_fully_replicated
  # Sharded init == unsharded init of the same weights (up to ulps: jitted sampling).
  eager = MoELM(cfg, rngs=nnx.Rngs(0)).layers[0].ffn.w_up[...]
  np.testing.assert_allclose(eager, ffn["w_up"][...], rtol=1e-6, atol=1e-7)
  step = make_train_step(graphdef, FNS, cfg, c.train, tx, mesh=mesh, state_shardings=shardings)
  for batch in _batches(2):
    ref, m_ref = ref_step(ref, batch)
    state, m = step(state, batch)
    assert abs(float(m["loss"]) - float(m_ref["loss"])) <= 1e-5 * float(m_ref["loss"])
    assert abs(float(m["grad_norm"]) - float(m_ref["grad_norm"])) <= 1e-5 * float(
        m_ref["grad_norm"])
    np.testing.assert_array_equal(m["moe"]["layer_0"]["load"], m_ref["moe"]["layer_0"]["load"])
    assert float(m["moe"]["layer_0"]["drop_frac"]) == 0.0
  for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
    assert rel_rms(a, b) < 1e-5
  np.testing.assert_allclose(jax.tree.leaves(state.biases)[0], jax.tree.leaves(ref.biases)[0],
                             atol=1e-6)
  w = state.params["layers"][0]["ffn"]["w_gate"][...]
  assert w.sharding.spec == shardings.params["layers"][0]["ffn"]["w_gate"].get_value().spec


def test_sharded_qb_bias_is_the_pooled_global_quantile():
  """Histograms summed over data x fsdp x expert shards give exactly the unsharded bias
  (and differ from averaging the per-shard quantiles, which is what a wrong psum gives)."""
  c = _config()
  cfg = model_config_from_dict(c.model).moe
  cfg = dataclasses.replace(cfg, num_experts=16, experts_per_token=2)
  model = MoE(32, cfg, norm_eps=1e-5, dtype="float32", rngs=nnx.Rngs(1))
  model.bias[...] = jnp.linspace(-0.2, 0.3, 16)
  x = jax.random.normal(jax.random.PRNGKey(2), (8, 16, 32)) * jnp.linspace(0.2, 3, 8)[:, None,
                                                                                      None]
  fwd = nnx.jit(lambda m, x, mask: m(x, mask=mask)[1])
  every = jnp.ones(x.shape[:2], bool)
  ref = fwd(model, x, every)
  with jax.set_mesh(make_mesh(data=2, fsdp=2, expert=2)):
    got = fwd(model, x, every)
  np.testing.assert_array_equal(got["qb_hist"], ref["qb_hist"])
  bias = model.bias[...]
  new_ref, new = update_bias(bias, ref, cfg), update_bias(bias, got, cfg)
  np.testing.assert_array_equal(new, new_ref)
  # Average of per-row-group quantiles (what pooling avoids) is measurably different.
  rows = jnp.arange(8)[:, None]
  shards = [fwd(model, x, every & (rows // 2 == i)) for i in range(4)]   # same compile
  lo, hi = qb_range(bias)
  per = [bias_from_histogram(s["qb_hist"], lo, hi, jnp.sum(s["load"]) / 16) for s in shards]
  assert float(jnp.max(jnp.abs(jnp.mean(jnp.stack(per), 0) - new))) > 1e-3


def test_rules_shard_every_leaf_consistently():
  mesh = make_mesh(fsdp=2, expert=2, tensor=2)
  shape = dict(mesh.shape)
  spec = lambda path, dims: rules.spec_for(rules.logical_names(path, len(dims)), dims, shape)
  assert spec("layers/1/ffn/w_gate", (8, 32, 64)) == jax.P("expert", "fsdp", "tensor")
  assert spec("opt_state/1/0/mu/layers/1/ffn/w_down", (8, 64, 32)) == jax.P("expert", "tensor",
                                                                            "fsdp")
  assert spec("layers/1/ffn/bias", (8,)) == jax.P()
  assert spec("embed/embedding", (259, 64)) == jax.P(None, "fsdp")   # 259 % 2: replicated
  assert spec("layers/0/mixer/q_proj/kernel", (64, 64)) == jax.P("fsdp", "tensor")
  assert spec("step", ()) == jax.P()
  assert spec("layers/1/ffn/w_gate", (8, 32)) == jax.P()             # rank mismatch


class _Untouchable:
  """Data that fails the test if the loop reads it (errors must come first)."""

  @property
  def train(self):
    raise AssertionError("data was read before the mesh was checked")

  eval_batches = train


@pytest.mark.parametrize("mesh,model,train,match", [
    (dict(data=3, fsdp=1), {}, {}, "mesh"),                          # 3 != 8 devices
    (dict(data=1, fsdp=1, expert=8), {"num_experts": 12}, {}, "model.moe.num_experts"),
    (dict(data=8, fsdp=1), {}, {"batch_size": 4}, "train.batch_size"),
    (dict(data=2, fsdp=4), {}, {"batch_size": 8, "grad_accum": 4}, "train.batch_size"),
])
def test_bad_mesh_input_fails_before_compile(tmp_path, mesh, model, train, match):
  c = _config()
  c.mesh.update(mesh)
  c.model.moe.update(model)
  c.train.update(train)
  with pytest.raises(ConfigError, match=match):
    runtime.setup(c, model_config_from_dict(c.model))
  with pytest.raises(ConfigError, match=match):
    train_and_evaluate(c, str(tmp_path / "run"), fns=FNS, data=_Untouchable())
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_single_device_mesh_is_the_plain_path():
  c = _config()
  c.mesh.update(dict(data=1, fsdp=-1, expert=1, tensor=1))
  rt = runtime.setup(c, model_config_from_dict(c.model), devices=jax.devices()[:1])
  assert rt.mesh is None and rt.step_kwargs() == {}
  assert mesh_cfg(data=2).data == 2
