"""Sparse MoE feed-forward: sigmoid router, latent experts, Quantile Balancing (DESIGN s4).

Conventions: B batch, T tokens, d hidden, m = B T tokens, E routed experts, k per token,
I expert width, n_in = expert input width (latent l, else d).
  router [d, E] fp32; bias [E] fp32 (RoutingBias state, never a Param);
  w_gate, w_up [E, n_in, I]; w_down [E, I, n_in]; all parameters fp32, matmuls in `dtype`.
The balancing bias only selects experts; the train step updates it from the additive stats
this layer returns (`layers.balancing`), outside the gradient and the optimizer.
Where the routed experts run is the execution plan's choice (`ops.plan`, read by
`run_experts`): without a dispatch here (`compute.moe_impl`: "ragged" sorted `ragged_dot`,
or the "dense" one-hot reference); the plan's expert-parallel dispatch
(`parallel.ep_moe.ExpertParallelDispatch`) runs them over a mesh and returns the statistics
psum-ed over every token shard.
Routing replay (RL, DESIGN s9): `replay` [B, T, k] int32 fixes which experts each token runs
(recorded by an earlier forward); their weights still come from the current router
(`ops.routing.replay_route`), so the router keeps its gradient. The balancing statistics
always describe the router's OWN fresh top-k (what QB has to balance), replay or not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import sharding
from hybridmoe_jax.config import ComputeConfig, MoEConfig
from hybridmoe_jax.layers.balancing import Stats, routing_stats
from hybridmoe_jax.layers.norms import RMSNorm
from hybridmoe_jax.ops.glu import get_glu
from hybridmoe_jax.ops.grouped_ffn import grouped_ffn
from hybridmoe_jax.ops.plan import ExecutionPlan, current_plan
from hybridmoe_jax.ops.routing import replay_route, sigmoid_topk_route

_F32 = jnp.float32


class RoutingBias(nnx.Variable):
  """Balancing bias [E] fp32: routing state, not a parameter (no gradient, no optimizer)."""


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> nnx.Param:
  """fp32 Param ~ N(0, 1/fan_in)."""
  init = nnx.initializers.normal(stddev=fan_in ** -0.5)
  return nnx.Param(init(rngs.params(), shape, _F32))


def _mm(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """x @ w in `dtype` with fp32 accumulation; returns fp32."""
  return jnp.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=_F32)


class GLUMLP(nnx.Module):
  """Full-width GLU FFN without biases: y = W_down glu(x W_gate, x W_up).

  Used for the dense first layer and the fused shared experts.
  """

  def __init__(self, d_in: int, d_hidden: int, *, glu: str, dtype: str, rngs: nnx.Rngs):
    self.glu = glu
    self.dtype = jnp.dtype(dtype)
    self.gate = _normal(rngs, (d_in, d_hidden), d_in)
    self.up = _normal(rngs, (d_in, d_hidden), d_in)
    self.down = _normal(rngs, (d_hidden, d_in), d_hidden)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., d_in] -> y [..., d_in] in the compute dtype (GLU itself in fp32)."""
    h = get_glu(self.glu)(_mm(x, self.gate[...], self.dtype), _mm(x, self.up[...], self.dtype))
    return _mm(h, self.down[...], self.dtype).astype(self.dtype)


def _ragged_experts(x, experts, weights, w_gate, w_up, w_down, glu, dtype):
  """Dropless grouped expert FFN over the m k assignments (`ops.grouped_ffn`).

  x [m, n_in] (dtype), experts [m, k] int32, weights [m, k] fp32 -> [m, n_in] fp32.
  Cost tracks m k, not m E.
  """
  m, k = experts.shape
  rows = jnp.arange(m * k, dtype=jnp.int32) // k              # assignment -> its token
  y = grouped_ffn(x, experts.reshape(-1), w_gate, w_up, w_down, glu=glu, dtype=dtype,
                  rows=rows).reshape(m, k, -1)
  return jnp.einsum("mk,mki->mi", weights, y, preferred_element_type=_F32)


def _dense_experts(x, experts, weights, w_gate, w_up, w_down, glu, dtype):
  """Reference: every expert on every token, combined by a one-hot [m, E] weight matrix.

  Same contract as `_ragged_experts`; cost m E.
  """
  num_experts = w_gate.shape[0]
  combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=_F32) * weights[..., None],
                    axis=1)                                   # [m, E]
  ein = lambda s, a, w: jnp.einsum(s, a.astype(dtype), w.astype(dtype),
                                   preferred_element_type=_F32)
  h = glu(ein("mi,eif->emf", x, w_gate), ein("mi,eif->emf", x, w_up))
  y = ein("emf,efi->emi", h, w_down)
  return jnp.einsum("me,emi->mi", combine, y)


_EXPERT_IMPLS = {"ragged": _ragged_experts, "dense": _dense_experts}


def choose(impl: str, plan: ExecutionPlan | None = None) -> tuple[str, str]:
  """Where the routed experts run (the dispatch table of `run_experts`): (name, reason),
  name "dispatch" (the plan's `moe_dispatch`) or a local `compute.moe_impl`."""
  plan = current_plan() if plan is None else plan
  d = plan.moe_dispatch
  if d is None:
    return impl, f"local {impl!r} experts (compute.moe_impl)"
  if impl != "ragged":
    raise ValueError(f"compute.moe_impl={impl!r} is invalid with an expert-parallel "
                     "dispatch: allowed 'ragged' (the dense one-hot path is single-device "
                     "only)")
  fields = [("mesh", dict(d.mesh.shape))] if getattr(d, "mesh", None) is not None else []
  fields += [(n, getattr(d, n)) for n in ("capacity_factor", "exchange") if hasattr(d, n)]
  return "dispatch", f"{type(d).__name__}({', '.join(f'{n}={v}' for n, v in fields)})"


def run_experts(route, run, xf, h, valid, replay, weights, experts, *, cfg: MoEConfig,
                impl: str, glu, dtype, rows: int | None = None):
  """Routes the m tokens and runs their experts where the plan says (`choose`): route
  (xf, replay, router, bias) -> (fresh, run Routes); run(fn, per_token, shared) on the
  tokens' devices; xf [m, d], h [m, n_in] (dtype), valid [m] bool | None, replay [m, k] |
  None, weights (router [d, E], bias [E]) fp32, experts (w_gate, w_up [E, n_in, I], w_down
  [E, I, n_in]), rows: B of the [B, T] batch the m tokens were flattened from (their
  layout, for the dispatch) -> (y [m, n_in] fp32, `routing_stats` of the m tokens,
  experts [m, k])."""
  name, _ = choose(impl)
  bias = weights[1]
  if name != "dispatch":
    def local(xf, h, valid, replay, router, bias, w_gate, w_up, w_down):
      fresh, routes = route(xf, replay, router, bias)
      y = _EXPERT_IMPLS[name](h, routes.experts, routes.weights, w_gate, w_up, w_down, glu,
                              dtype)
      return (y, routes.experts), routing_stats(fresh, bias, valid, cfg)

    (y, chosen), stats = run(local, (xf, h, valid, replay), weights + experts)
    return y, stats, chosen
  (fresh, routes), _ = run(lambda *a: (route(*a), {}), (xf, replay), weights)
  ok = jnp.ones(h.shape[:1], bool) if valid is None else valid
  replayed = {} if replay is None else {"stats_routes": fresh}
  y, stats = current_plan().moe_dispatch(h, routes, bias, ok, *experts, cfg=cfg, glu=glu,
                                         dtype=dtype, rows=rows, **replayed)
  return y, stats, routes.experts


class MoE(nnx.Module):
  """Routed (optionally latent) experts plus fused shared experts.

  latent:  y = W_up RMSNorm(sum_e p_e Expert_e(W_down x)) + Shared(x)
  else:    y = sum_e p_e Expert_e(x) + Shared(x)
  with routes and p from `sigmoid_topk_route` (the bias chooses, the scores weigh), or
  under replay the given routes and p from `replay_route`.
  Where the routed experts run is `run_experts`' choice (the plan's `moe_dispatch`, which
  needs moe_impl "ragged", or this device). Under a plan whose context runner lays the
  batch out over its token axes, the routing (and the local experts
  and the statistics) run on each device's own tokens, never on the gathered sequence.
  """

  def __init__(self, d_model: int, cfg: MoEConfig, *, norm_eps: float,
               compute: ComputeConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.impl = compute.moe_impl
    self.weight_cast = compute.moe_weight_cast
    self.dtype = jnp.dtype(compute.dtype)
    e, i_dim = cfg.num_experts, cfg.expert_intermediate
    n_in = cfg.latent_dim or d_model
    self.router = _normal(rngs, (d_model, e), d_model)
    self.bias = RoutingBias(jnp.zeros((e,), _F32))
    if cfg.latent_dim:
      self.latent_down = _normal(rngs, (d_model, n_in), d_model)
      self.latent_norm = RMSNorm(n_in, eps=norm_eps)
      self.latent_up = _normal(rngs, (n_in, d_model), n_in)
    self.w_gate = _normal(rngs, (e, n_in, i_dim), n_in)
    self.w_up = _normal(rngs, (e, n_in, i_dim), n_in)
    self.w_down = _normal(rngs, (e, i_dim, n_in), i_dim)
    width = cfg.num_shared_experts * cfg.shared_intermediate
    self.shared = (GLUMLP(d_model, width, glu=cfg.glu, dtype=compute.dtype, rngs=rngs)
                   if width else None)

  def __call__(self, x: jax.Array, *, mask: jax.Array | None = None,
               replay: jax.Array | None = None) -> tuple[jax.Array, Stats, jax.Array]:
    """Apply the MoE FFN and collect this batch's balancing statistics.

    Args:
      x: [B, T, d] activations (any float dtype).
      mask: optional [B, T] bool, True for real tokens; padding is still computed but
        excluded from the statistics.
      replay: optional [B, T, k] int expert ids to run instead of the router's top-k
        (routing replay): distinct per token, each in [0, E) (the values are not checked
        here, see `model.decoder.check_routes`); the weights are the current router's
        scores at those experts, normalised as without replay.

    Returns:
      y: [B, T, d] in the compute dtype.
      stats: `layers.balancing.routing_stats` of the B T tokens (additive int32 arrays:
        "load" [E], "dropped" [], "qb_hist" [E, qb_num_bins] with balancing "qb"),
        over the whole batch on either path. Under replay "load" and "qb_hist" still
        come from the router's own fresh top-k with the current bias (what the balancer
        must correct); "dropped" counts the assignments actually run (the replayed ones).
      experts: [B, T, k] int32, the experts each token ran (= `replay` when given), best
        first without replay; what a later forward replays.

    Raises:
      ValueError: `replay` is not an integer [B, T, k] array.
    """
    cfg, dtype = self.cfg, self.dtype
    b, t, d = x.shape
    k = cfg.experts_per_token
    if replay is not None and (tuple(replay.shape) != (b, t, k)
                               or not jnp.issubdtype(replay.dtype, jnp.integer)):
      raise ValueError(f"replay must be integer expert ids [B, T, k] = {(b, t, k)}, got "
                       f"{replay.dtype} {tuple(replay.shape)}")
    x = sharding.constrain(x, ("batch", "length", "act_embed"))
    # Under a context runner every token-wise step runs where the tokens are: XLA does not
    # partition top_k (nor the experts' sort) along the tokens and would gather the whole
    # sequence's [B T, E] scores (or its [B T, d] inputs) onto every device.
    ctx = current_plan().context
    ctx = ctx if ctx is not None and ctx.splits(b, t) else None
    if ctx is None:
      flat = lambda a: None if a is None else a.reshape(b * t, *a.shape[2:])
      unflat = lambda a: a.reshape(b, t, *a.shape[1:])
      run = lambda fn, per_token, shared: fn(*per_token, *shared)
    else:
      flat = lambda a: None if a is None else ctx.flatten_tokens(a)
      unflat = lambda a: ctx.unflatten_tokens(a, b, t)
      run = functools.partial(ctx.tokenwise, rows=b)
    h = x.astype(dtype)
    if cfg.latent_dim:
      h = _mm(h, self.latent_down[...], dtype).astype(dtype)
    xf, h, valid, replay = flat(x), flat(h), flat(mask), flat(replay)
    glu = get_glu(cfg.glu)

    def route(xf, replay, router, bias):
      """Fresh top-k of these tokens, and the routes they run (replayed or fresh)."""
      # Router in fp32 at full precision: bf16/TF32 logits would flip near-tied routes.
      logits = jnp.dot(xf.astype(_F32), router, precision=jax.lax.Precision.HIGHEST)
      fresh = sigmoid_topk_route(logits, bias, k, routed_scale=cfg.routed_scale,
                                 renormalize=cfg.renormalize)
      if replay is None:
        return fresh, fresh
      return fresh, replay_route(logits, replay.astype(jnp.int32), bias=bias,
                                 routed_scale=cfg.routed_scale, renormalize=cfg.renormalize)

    weights = (self.router[...], self.bias[...])
    experts = (self.w_gate[...], self.w_up[...], self.w_down[...])
    if self.weight_cast == "sharded":  # compute.moe_weight_cast: cast where the shard lives
      # Outside the dispatch's shard_map, an elementwise cast takes its operand's (the
      # parameter's) sharding, so the gather that feeds the shard_map moves dtype bytes.
      experts = tuple(w.astype(dtype) for w in experts)
    y, stats, chosen = run_experts(route, run, xf, h, valid, replay, weights, experts,
                                   cfg=cfg, impl=self.impl, glu=glu, dtype=dtype, rows=b)
    # Back to [B, T, ...] before the rest: there the token-wise matmuls see one layout
    # (an expert-parallel y comes back split over `expert` too).
    y = unflat(y)
    if cfg.latent_dim:
      y = _mm(self.latent_norm(y), self.latent_up[...], dtype)
    if self.shared is not None:
      y = y + self.shared(x).astype(_F32)
    y = sharding.constrain(y.astype(dtype), ("batch", "length", "act_embed"))
    return y, stats, unflat(chosen)
