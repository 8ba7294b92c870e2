"""Sharded train step == unsharded train step; QB bias from pooled histograms; mesh errors.

The model is the tiny real HybridLM of the train tests (2 MLA layers, d_model 16, the second
with an 8-expert MoE); the runtime, its expert-parallel dispatch, the step, the optimizer,
the routing-bias update and the state layout are the production ones.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, ConfigError, model_config_from_dict
from hybridmoe_jax.layers.balancing import update_bias
from hybridmoe_jax.layers.moe import MoE
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.ops.quantile_balance import bias_from_histogram, qb_range
from hybridmoe_jax.ops.plan import LOCAL, ExecutionPlan, execution_plan
from hybridmoe_jax.parallel import rules, runtime
from hybridmoe_jax.parallel.ep_moe import ExpertParallelDispatch
from hybridmoe_jax.parallel.mesh import mesh_shape
from hybridmoe_jax.train import optim
from hybridmoe_jax.config.run import run_config_from_dict
from hybridmoe_jax.train.loop import train_and_evaluate
from hybridmoe_jax.train.stage_plan import build_plan
from hybridmoe_jax.train.state import abstract_train_state, create_train_state
from hybridmoe_jax.train.step import make_train_step
from tests._support import mini_model_config, rel_rms
from tests.conftest import load_config
from tests.parallel.helpers import make_mesh

MOE = "layers/1/ffn"   # the tiny model's MoE layer, as metrics["moe"] names it
COMPUTE = ComputeConfig()


def _config():
  c = load_config("tiny")
  c.model.moe.update(num_experts=8, experts_per_token=2, qb_num_bins=128)
  c.train.update(batch_size=4, seq_len=8, lr=1e-2, warmup=0)
  return c


def _setup(c, mesh_sizes, compute=COMPUTE, **kw):
  t = c.train
  return runtime.setup(mesh_sizes, model_config_from_dict(c.model), compute,
                       batch_size=t.batch_size, grad_accum=t.grad_accum, seq_len=t.seq_len, **kw)


def _batches(n, vocab):
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    segs = np.ones((4, 8), np.int32)
    segs[1, 5:] = 0
    out.append({"tokens": rng.integers(0, vocab, (4, 8)).astype(np.int32),
                "segment_ids": segs})
  return out


# data x expert=4 is slow: data x expert x context runs the same step with every axis but one.
@pytest.mark.parametrize("sizes", [pytest.param(dict(data=2, expert=4), marks=pytest.mark.slow),
                                   dict(data=2, expert=2, context=2)])
def test_sharded_train_step_equals_unsharded(sizes):
  """The production step on a mesh; with `context`, each sequence is split over 2 shards
  (the MLA layers attend over gathered latents, parallel/context.py)."""
  c = _config()
  cfg = mini_model_config(num_experts=8, experts_per_token=2, qb_num_bins=128)
  run = run_config_from_dict(c)
  schedule = build_plan(run).schedule()
  tx = optim.make_optimizer(run.train, schedule)
  rt = _setup(c, sizes)
  dispatch = rt.plan.moe_dispatch
  assert isinstance(dispatch, ExpertParallelDispatch) and dispatch.mesh is rt.mesh
  assert (rt.plan.context is not None) == ("context" in sizes)
  graphdef, abstract = abstract_train_state(cfg, COMPUTE, tx, 0)
  state = rt.init_state(lambda: create_train_state(cfg, COMPUTE, tx, 0)[1], abstract)
  # The reference: the same values on one device, the plain (local experts, unsharded) step
  # of the same graph (the plan, not the graphdef, says where the ops run).
  ref_graphdef, _ = abstract_train_state(cfg, COMPUTE, tx, 0)
  assert ref_graphdef == graphdef
  ref = jax.device_put(jax.device_get(state), jax.devices()[0])
  step_args = dict(grad_accum=run.train.grad_accum, schedule=schedule)
  ref_step = make_train_step(ref_graphdef, cfg, tx, **step_args)
  # Expert weights and their Adam moments live on the expert axis, the bias is replicated.
  ffn = state.params["layers"][1]["ffn"]
  assert ffn["w_gate"][...].sharding.spec[0] == "expert"
  if "context" in sizes:   # the state is split over the context shards too (ZeRO over them)
    assert ffn["w_gate"][...].sharding.spec[1] == "context"
  mu = state.opt_state[1][0].mu["layers"][1]["ffn"]["w_gate"][...]
  assert mu.sharding.spec == ffn["w_gate"][...].sharding.spec
  assert state.biases["layers"][1]["ffn"]["bias"][...].sharding.is_fully_replicated
  # Sharded init == unsharded init of the same weights (up to ulps: jitted sampling).
  eager = HybridLM(cfg, rngs=nnx.Rngs(0), compute=COMPUTE).layers[1].ffn.w_up[...]
  np.testing.assert_allclose(eager, ffn["w_up"][...], rtol=1e-6, atol=1e-7)
  step = make_train_step(graphdef, cfg, tx, **step_args, **rt.step_kwargs())
  for batch in _batches(2, cfg.vocab_size):
    ref, m_ref = ref_step(ref, batch)
    state, m = step(state, batch)
    assert abs(float(m["loss"]) - float(m_ref["loss"])) <= 1e-5 * float(m_ref["loss"])
    assert abs(float(m["grad_norm"]) - float(m_ref["grad_norm"])) <= 1e-5 * float(
        m_ref["grad_norm"])
    np.testing.assert_array_equal(m["moe"][MOE]["load"], m_ref["moe"][MOE]["load"])
    assert float(m["moe"][MOE]["drop_frac"]) == 0.0
  for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params)):
    assert rel_rms(b, a) < 1e-5
  np.testing.assert_allclose(jax.tree.leaves(state.biases)[0], jax.tree.leaves(ref.biases)[0],
                             atol=1e-6)
  w = state.params["layers"][1]["ffn"]["w_gate"][...]
  want = rt.state_shardings.params["layers"][1]["ffn"]["w_gate"].get_value()
  assert w.sharding.spec == want.spec


def test_sharded_qb_bias_is_the_pooled_global_quantile():
  """Histograms summed over data x fsdp x expert shards give exactly the unsharded bias
  (and differ from averaging the per-shard quantiles, which is what a wrong psum gives)."""
  c = _config()
  cfg = model_config_from_dict(c.model).moe
  cfg = dataclasses.replace(cfg, num_experts=16, experts_per_token=2)
  mesh = make_mesh(data=2, fsdp=2, expert=2)
  model = MoE(32, cfg, norm_eps=1e-5, compute=COMPUTE, rngs=nnx.Rngs(1))
  model.bias[...] = jnp.linspace(-0.2, 0.3, 16)
  x = jax.random.normal(jax.random.PRNGKey(2), (8, 16, 32)) * jnp.linspace(0.2, 3, 8)[:, None,
                                                                                      None]

  def fwd(plan):
    def stats(m, x, mask):
      with execution_plan(plan):
        return m(x, mask=mask)[1]
    return nnx.jit(stats)

  every = jnp.ones(x.shape[:2], bool)
  local = fwd(None)
  ref = local(model, x, every)
  with jax.set_mesh(mesh):
    got = fwd(ExecutionPlan(moe_dispatch=ExpertParallelDispatch(mesh)))(model, x, every)
  np.testing.assert_array_equal(got["qb_hist"], ref["qb_hist"])
  np.testing.assert_array_equal(got["load"], ref["load"])
  bias = model.bias[...]
  new_ref, new = update_bias(bias, ref, cfg), update_bias(bias, got, cfg)
  np.testing.assert_array_equal(new, new_ref)
  # Average of per-row-group quantiles (what pooling avoids) is measurably different.
  rows = jnp.arange(8)[:, None]
  shards = [local(model, x, every & (rows // 2 == i)) for i in range(4)]   # same compile
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
  # 259 % 2: the vocabulary replicated; the width over fsdp and expert, like every
  # non-expert weight (MaxText's embed rule)
  assert spec("embed/embedding", (259, 64)) == jax.P(None, ("fsdp", "expert"))
  assert spec("layers/0/mixer/q_proj/kernel", (64, 64)) == jax.P(("fsdp", "expert"), "tensor")
  assert spec("step", ()) == jax.P()
  assert spec("layers/1/ffn/w_gate", (8, 32)) == jax.P()             # rank mismatch
  # The context axis shards the state too: with it, the model width splits over fsdp x
  # context (x expert for the non-expert weights).
  shape = dict(make_mesh(fsdp=2, expert=2, context=2).shape)
  assert spec("layers/0/mixer/q_proj/kernel", (64, 64)) == jax.P(("fsdp", "context", "expert"))
  assert spec("layers/1/ffn/w_gate", (8, 32, 64)) == jax.P("expert", ("fsdp", "context"))
  assert spec("layers/0/mixer/q_proj/kernel", (66, 64)) == jax.P("fsdp")  # 66 % 4: fsdp only
  # Serving replicates the weights over context (the cache is what the context axis splits)
  # and the non-expert ones over expert; routed experts stay on their expert shards.
  mesh = make_mesh(fsdp=2, expert=2, context=2)
  tree = {"layers": {"0": {"mixer": {"q_proj": {"kernel": jax.ShapeDtypeStruct((64, 64),
                                                                              "float32")}}}}}
  tree["layers"]["1"] = {"ffn": {"w_gate": jax.ShapeDtypeStruct((8, 32, 64), "float32")}}
  for serving, want, want_expert in (
      (False, jax.P(("fsdp", "context", "expert")), jax.P("expert", ("fsdp", "context"))),
      (True, jax.P("fsdp"), jax.P("expert", "fsdp"))):
    got = rules.tree_shardings(tree, mesh, serving=serving)
    assert got["layers"]["0"]["mixer"]["q_proj"]["kernel"].spec == want
    assert got["layers"]["1"]["ffn"]["w_gate"].spec == want_expert


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
    (dict(data=1, fsdp=1, context=8), {}, {"seq_len": 12}, "train.seq_len.*mesh.context"),
    (dict(data=1, fsdp=4, expert=2, context_zigzag=True), {}, {}, "mesh.context_zigzag"),
    (dict(data=1, fsdp=4, context=2, context_zigzag=True), {}, {"seq_len": 6},
     r"train.seq_len.*2 x mesh.context"),
    (dict(data=1, fsdp=4, context=2, context_zigzag=True), {}, {}, "train.seq_len.*conv_size"),
])
def test_bad_mesh_input_fails_before_compile(tmp_path, mesh, model, train, match):
  c = _config()
  c.mesh.update(mesh)
  c.model.moe.update(model)
  c.train.update(train)
  with pytest.raises(ConfigError, match=match):
    _setup(c, dict(c.mesh))
  with pytest.raises(ConfigError, match=match):
    train_and_evaluate(run_config_from_dict(c), str(tmp_path / "run"), data=_Untouchable())
  assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("mla,field", [({"rope_theta": 1e4}, "model.mla.rope_theta"),
                                       ({"logn_base": 64}, "model.mla.logn_base")])
def test_mla_positions_under_context_parallelism_fail_at_setup(tmp_path, mla, field):
  """RoPE / logn MLA is refused under a context runner: a ConfigError naming the field from
  the runtime, before the state is initialised (layers/mla.py raised it only when the step
  was traced); without a context axis the same model sets up."""
  c = _config()
  c.train.seq_len = 16
  c.model.mla.update(mla)
  c.mesh.update(data=1, fsdp=4, context=2)
  with pytest.raises(ConfigError, match=rf"`{field}` = .* allowed 0 with mesh.context=2"):
    _setup(c, dict(c.mesh))
  with pytest.raises(ConfigError, match=field):
    train_and_evaluate(run_config_from_dict(c), str(tmp_path / "run"), data=_Untouchable())
  assert _setup(c, dict(data=1, fsdp=4, expert=2)).plan.context is None


def test_zigzag_flag_reaches_the_context_runner():
  c = _config()
  c.train.seq_len = 16
  sizes = dict(data=2, expert=2, context=2)
  assert not _setup(c, sizes).plan.context.zigzag
  rt = _setup(c, dict(sizes, context_zigzag=True))
  assert rt.plan.context.zigzag and rt.plan.context.size == 2


def test_single_device_mesh_is_the_plain_path():
  rt = _setup(_config(), dict(data=1, fsdp=-1, expert=1, tensor=1), devices=jax.devices()[:1])
  assert rt.mesh is None and rt.plan == LOCAL and rt.step_kwargs() == {}


def test_dense_moe_impl_stays_local_on_a_mesh():
  rt = _setup(_config(), dict(data=2, expert=4), ComputeConfig(moe_impl="dense"))
  assert rt.mesh is not None and rt.plan.moe_dispatch is None


def test_mesh_shape_resolves_and_names_bad_fields():
  assert mesh_shape({"fsdp": -1}, 8) == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1,
                                           "context": 1}
  assert mesh_shape(dict(data=1, fsdp=-1, expert=4, tensor=1), 8)["fsdp"] == 2
  for sizes, match in (({"pipe": 2}, "`mesh`.*axes among"), ({"data": 0}, "mesh.data"),
                       ({"data": -1, "fsdp": -1}, "at most one"),
                       ({"expert": -1, "data": 3}, "mesh.expert.*divide"),
                       ({"data": 4}, "product is the 8 device")):
    with pytest.raises(ConfigError, match=match):
      mesh_shape(sizes, 8)


def test_a_stage_the_resolved_mesh_cannot_split_fails_before_the_data(tmp_path):
  """mesh.fsdp=-1 resolves to the 8 devices only at start-up, where RunConfig.check cannot
  see it: curriculum_cpu's 4k stage (2 sequences a step) cannot split over 8 data shards.
  Refused before the data is read or a state built, naming the stage (it failed only when
  that stage started, after the earlier stages had trained)."""
  run = run_config_from_dict(load_config("curriculum_cpu"))
  assert run.mesh.fsdp == -1 and run.mesh.data == 1
  with pytest.raises(ConfigError, match=r"curriculum stage 2 \(4k: 2 sequences of 4096 tokens "
                                        r"a step\) does not fit mesh .*'fsdp': 8"):
    train_and_evaluate(run, str(tmp_path / "run"), data=_Untouchable())
  assert not (tmp_path / "run" / "checkpoints").exists()
  run = run_config_from_dict(load_config("curriculum_cpu"))   # 8k stage and eval: 1 row
  curriculum = dataclasses.replace(run.curriculum, stages=run.curriculum.stages[:2],
                                   eval_seq_len=8192)
  run = dataclasses.replace(run, curriculum=curriculum,
                            train=dataclasses.replace(run.train, steps=10))
  with pytest.raises(ConfigError, match=r"held-out batches at 8,192 tokens \(1 sequences"):
    train_and_evaluate(run, str(tmp_path / "run2"), data=_Untouchable())
