"""The execution plan (`ops.plan`) and the ops' dispatch tables that read it: each `choose`
names the implementation a plan gets, and why."""

import jax.numpy as jnp
import pytest

from hybridmoe_jax.layers import moe
from hybridmoe_jax.ops.attention import api as attention
from hybridmoe_jax.ops.conv import short_conv
from hybridmoe_jax.ops.kda import choose
from hybridmoe_jax.ops.plan import LOCAL, ExecutionPlan, current_plan, execution_plan


class _Runner:
  """A stand-in context runner: records which of its methods an op called."""

  def __init__(self, shards_cache=False):
    self.shards_cache, self.calls = shards_cache, []

  def short_conv(self, x, w, *, segment_ids=None):
    self.calls.append(("short_conv", current_plan()))
    return x


KDA = dict(head_dim=32, v_head_dim=32, chunk_size=64, lower_bound=-5.0, backend="cpu")
MLA = dict(backend="cpu", block=8, head_dim=16, v_head_dim=16, dtype="float32",
           has_segments=True)


def test_the_plan_is_scoped_and_local_by_default():
  plan = ExecutionPlan(context=_Runner())
  assert current_plan() is LOCAL and not LOCAL.shards_cache
  with execution_plan(plan):
    assert current_plan() is plan
    with execution_plan(None):
      assert current_plan() is LOCAL
  assert current_plan() is LOCAL
  assert ExecutionPlan(context=_Runner(shards_cache=True)).shards_cache


def test_kda_choose_per_plan():
  training, cached = dict(tokens=64, continues=False), dict(tokens=64, continues=True)
  assert choose("auto", **KDA, **training)[0] == "chunked"                 # LOCAL, CPU
  assert choose("recurrent", **KDA, **training)[:2] == ("recurrent", "requested")
  ctx = ExecutionPlan(context=_Runner())
  assert choose("auto", **KDA, **training, plan=ctx)[0] == "context"
  assert choose("auto", **KDA, **cached, plan=ctx)[0] == "chunked"   # no sharded cache
  sharded = ExecutionPlan(context=_Runner(shards_cache=True))
  assert choose("auto", **KDA, **cached, plan=sharded)[0] == "context_continue"
  one_token = dict(cached, tokens=1)                                 # decode: replicated
  assert choose("recurrent", **KDA, **one_token, plan=sharded)[0] == "recurrent"
  with execution_plan(ctx):                                          # the current plan
    assert choose("auto", **KDA, **training)[0] == "context"
  with pytest.raises(ValueError, match="impl must be one of"):
    choose("flash", **KDA, **training, plan=ctx)


def test_kda_choose_falls_back_from_pallas_with_the_domain_error():
  name, why, *_ = choose("auto", **dict(KDA, backend="gpu", head_dim=24), tokens=64,
                     continues=False)
  assert name == "chunked" and why                                   # the kernel's reason
  assert choose("auto", **dict(KDA, backend="gpu"), tokens=64, continues=False)[0] == "pallas"


def test_latent_attention_choose_per_plan():
  ctx = ExecutionPlan(context=_Runner())
  assert attention.choose("auto", plan=LOCAL, seq_len=8, **MLA)[0] == "dense"
  name, why = attention.choose("auto", plan=ctx, seq_len=8, **MLA)
  assert name == "context" and "_Runner" in why
  assert attention.choose_cached(LOCAL)[0] == "absorbed"
  assert attention.choose_cached(ctx)[0] == "absorbed"
  assert attention.choose_cached(
      ExecutionPlan(context=_Runner(shards_cache=True)))[0] == "context_cache"


def test_moe_choose_per_plan():
  assert moe.choose("ragged", LOCAL) == ("ragged", "local 'ragged' experts (compute.moe_impl)")
  name, why = moe.choose("ragged", ExecutionPlan(moe_dispatch=_Runner()))
  assert name == "dispatch" and why.startswith("_Runner(")
  with pytest.raises(ValueError, match="compute.moe_impl='dense'"):
    moe.choose("dense", ExecutionPlan(moe_dispatch=_Runner()))


def test_short_conv_delegates_whole_sequences_under_the_local_plan():
  """A runner's per-shard body calls the same op: it must run locally, not recurse."""
  runner = _Runner()
  x, w = jnp.ones((1, 4, 2)), jnp.ones((3, 2))
  with execution_plan(ExecutionPlan(context=runner)):
    short_conv(x, w)
    short_conv(x, w, history=jnp.zeros((1, 2, 2)))                   # a cache: local
  assert runner.calls == [("short_conv", LOCAL)]
