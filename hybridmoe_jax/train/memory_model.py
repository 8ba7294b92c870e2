"""What a training step keeps for its backward pass, counted by JAX itself.

The dry run's activation memory is not hand-counted: `residual_bytes` traces the model's
forward (nothing is compiled or run) and asks JAX which values `jax.vjp` keeps for the
backward pass under each remat policy (the residuals, excluding the parameters and inputs,
which are stored anyway). That list already holds everything the layers save: projections,
conv outputs, gates, the chunked KDA scan's per-step fp32 states, MLA latents and the
blockwise core's log-sum-exp, router scores and expert hidden states.

Two numbers per policy, per token of one sequence:
  saved:  what the whole model keeps from the forward until the backward reaches it;
  peak:   what the largest single decoder layer keeps when it runs without remat: under
          "full" / "dots" the backward recomputes one layer at a time and holds its
          residuals while it does (none: 0, they are already in `saved`).
Models up to FULL_TRACE_MAX_LAYERS layers are traced whole; deeper ones as one-layer models,
one per distinct decoder layer, times how often each occurs. Lengths up to `EXACT_MAX_T`
are traced as they are, and at half of it: the difference gives the bytes per token, the rest
is a fixed part (weight copies). Longer lengths use the figures at EXACT_MAX_T with the MLA
core that `compute.mla_impl` picks at the target length forced: every residual of a layer
is linear in T there (tiny: 91,974 B/token at 1K, 91,955 at 64K). A dense MLA core (short
T only) is quadratic: its T^2 part lands in the per-token figure, exact at the target T.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import ComputeConfig, ModelConfig
from hybridmoe_jax.model import HybridLM
from hybridmoe_jax.ops.attention.api import memory_core

EXACT_MAX_T = 4096


def _residual_bytes(fn, *args) -> int:
  """Bytes of the values `jax.vjp(fn, *args)` keeps for the backward pass, excluding the
  arguments themselves (parameters and inputs exist anyway) and constants."""
  closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a), return_shape=True)(*args)
  n_res = len(jax.tree.leaves(shapes[1]))
  jaxpr = closed.jaxpr
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)
  total, seen = 0, set()
  for v in jaxpr.outvars[len(jaxpr.outvars) - n_res:]:
    if type(v).__name__ != "Var" or v in inputs or v in seen:
      continue  # literals, parameters / inputs, duplicates
    seen.add(v)
    total += math.prod(v.aval.shape) * v.aval.dtype.itemsize
  return total


@functools.lru_cache(maxsize=64)
def _abstract_model(cfg: ModelConfig, compute: ComputeConfig):
  """HybridLM(cfg, compute) built abstractly (no arrays) and split into (graphdef, params,
  rest). Building costs about as much as one trace: one build serves both lengths and all
  three remat policies (`_traced` swaps the policy in)."""
  model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0), compute=compute))
  return nnx.split(model, nnx.Param, ...)


@functools.lru_cache(maxsize=256)
def _traced(cfg: ModelConfig, compute: ComputeConfig, rows: int, t: int) -> int:
  """Residual bytes of HybridLM(cfg) on [rows, t] tokens (one document per row)."""
  graphdef, params, rest = _abstract_model(cfg, dataclasses.replace(compute, remat="none"))
  if compute.remat != "none":  # only HybridLM.__call__ reads the policy (it wraps each layer
    # in nnx.remat): the same parameters with the model's own `compute` swapped
    model = nnx.merge(graphdef, params, rest)
    model.compute = compute
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.ShapeDtypeStruct((rows, t), jnp.int32)

  def forward(params, rest, tokens):
    logits, _ = nnx.merge(graphdef, params, rest)(tokens)
    return logits

  return _residual_bytes(forward, params, rest, tokens)  # abstract: nothing allocated


def _layer_variants(cfg: ModelConfig) -> list[tuple[ModelConfig, int]]:
  """(one-layer model, multiplicity) per distinct (mixer kind, dense/MoE) layer of cfg."""
  out = []
  for (kind, is_moe), layers in cfg.layer_variants().items():
    moe = dataclasses.replace(cfg.moe, first_dense_layers=0 if is_moe else 1)
    out.append((dataclasses.replace(cfg, num_layers=1, layer_kinds=(kind,), moe=moe),
                len(layers)))
  return out


FULL_TRACE_MAX_LAYERS = 12  # deeper models: one-layer variants times their multiplicity


@functools.lru_cache(maxsize=64)
def _per_token(cfg: ModelConfig, compute: ComputeConfig, t: int) -> dict[str, dict[str, float]]:
  """{remat: {"saved": B/token, "peak": B/token}} at length t, traced exactly."""
  at = lambda c, remat: _traced(c, dataclasses.replace(compute, remat=remat), 1, t)
  variants = _layer_variants(cfg)
  peak_none = max(at(v, "none") - at(v, "full") for v, _ in variants)
  out = {}
  for remat in ("none", "dots", "full"):
    if cfg.num_layers <= FULL_TRACE_MAX_LAYERS:
      saved = at(cfg, remat)
    else:  # tracing 60-90 layers takes minutes; the embedding / head part is counted per
      # variant (a few d-wide tensors, at most 4 times), AttnRes mixes at one block's width
      saved = sum(n * at(v, remat) for v, n in variants)
    out[remat] = {"saved": saved / t, "peak": 0.0 if remat == "none" else peak_none / t}
  return out


def residual_bytes(cfg: ModelConfig, compute: ComputeConfig, seq_len: int
                   ) -> dict[str, dict[str, float]]:
  """Residual bytes per token of one sequence of `seq_len` tokens, per remat policy.

  Args:
    cfg, compute: the model and its runtime knobs (dtype, kernel impls, MLA core).
    seq_len: T, the tokens of one sequence (the MLA core attends over all of them).
  Returns:
    {"none" | "dots" | "full": {"saved", "peak": bytes per token; "saved_fixed",
    "peak_fixed": bytes whatever T (the compute-dtype copies of the weights that the
    backward reuses: sharded like the parameters)}}; see the module docstring. KDA traces with its chunked XLA form (what runs on CPU; the
    Pallas kernels keep no more).
  """
  kda = "chunked" if compute.kda_impl in ("auto", "pallas") else compute.kda_impl
  core = memory_core(compute.mla_impl, seq_len, compute.mla_block)
  compute = dataclasses.replace(compute, kda_impl=kda, mla_impl=core)
  t2 = min(seq_len, EXACT_MAX_T)
  t1 = max(t2 // 2, 1)
  a, b = _per_token(cfg, compute, t1), _per_token(cfg, compute, t2)
  out = {}
  for remat in a:
    out[remat] = {}
    for part in ("saved", "peak"):
      per_token = (b[remat][part] * t2 - a[remat][part] * t1) / (t2 - t1) if t2 > t1 else 0.0
      out[remat][part] = max(per_token, 0.0)
      out[remat][part + "_fixed"] = max(b[remat][part] * t2 - per_token * t2, 0.0)
  return out
