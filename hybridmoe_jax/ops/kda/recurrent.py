"""KDA token recurrence: the exact reference every other implementation must match.

Conventions (DESIGN s1): q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] log decay
(<= 0); beta: [B, T, HV]; state S: [B, HV, K, V] float32; o: [B, T, HV, V] in v's dtype.
Value head h reads q/k head h // (HV // H). q and k are expected L2-normalised already.
Per token:  S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - k_t^T S)^T;  o_t = scale q_t^T S.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda.segments import segment_starts

_HIGHEST = jax.lax.Precision.HIGHEST


def check_kda_inputs(q, k, v, g, beta, initial_state=None, segment_ids=None) -> None:
  """Validates the shapes of the KDA contract (shared by every implementation).

  Raises:
    ValueError: naming the first argument whose rank or shape is wrong.
  """
  for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
    if np.ndim(x) != rank:
      raise ValueError(f"{name} must have rank {rank}, got shape {np.shape(x)}")
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  if k.shape != q.shape:
    raise ValueError(f"k must have the shape of q [B, T, H, K] = {q.shape}, got {k.shape}")
  if v.shape[:2] != (B, T):
    raise ValueError(f"v must have batch/time [B, T] = {(B, T)} like q, got shape {v.shape}")
  if HV % H != 0:
    raise ValueError(f"v heads HV={HV} must be a multiple of q/k heads H={H}; v shape {v.shape}")
  if g.shape != (B, T, HV, K):
    raise ValueError(f"g must have shape [B, T, HV, K] = {(B, T, HV, K)}, got {g.shape}")
  if beta.shape != (B, T, HV):
    raise ValueError(f"beta must have shape [B, T, HV] = {(B, T, HV)}, got {beta.shape}")
  if initial_state is not None and np.shape(initial_state) != (B, HV, K, V):
    raise ValueError(f"initial_state must have shape [B, HV, K, V] = {(B, HV, K, V)}, "
                     f"got {np.shape(initial_state)}")
  if segment_ids is not None:
    if np.shape(segment_ids) != (B, T):
      raise ValueError(f"segment_ids must have shape [B, T] = {(B, T)}, "
                       f"got {np.shape(segment_ids)}")
    dtype = jnp.asarray(segment_ids).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
      raise ValueError(f"segment_ids must be an integer array, got dtype {dtype} "
                       f"(shape {np.shape(segment_ids)})")


def kda_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                  scale: float | None = None, initial_state: jax.Array | None = None,
                  output_final_state: bool = False, segment_ids: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array | None]:
  """Kimi Delta Attention as a token-by-token scan (fp32 state); exact reference.

  Arguments and result as `ops.kda.kda`'s (shapes in the module docstring): the state is
  zeroed at every token whose segment id differs from the previous token's.
  """
  check_kda_inputs(q, k, v, g, beta, initial_state, segment_ids)
  B, T, H, K = q.shape
  HV, V = v.shape[2], v.shape[3]
  scale = K**-0.5 if scale is None else scale
  f32 = jnp.float32
  rep = HV // H
  q = jnp.repeat(q.astype(f32), rep, axis=2) * scale
  k = jnp.repeat(k.astype(f32), rep, axis=2)
  if segment_ids is None:
    reset = jnp.zeros((B, T), bool)
  else:
    reset = segment_starts(segment_ids)
  state = jnp.zeros((B, HV, K, V), f32) if initial_state is None else initial_state.astype(f32)

  def step(s, xs):
    q_t, k_t, v_t, g_t, b_t, r_t = xs
    # Zero the state before the decay: a new segment starts from nothing.
    s = jnp.where(r_t[:, None, None, None], 0.0, s)
    s = s * jnp.exp(g_t)[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", k_t, s, precision=_HIGHEST)
    delta = b_t[..., None] * (v_t - pred)
    s = s + k_t[..., :, None] * delta[..., None, :]
    o_t = jnp.einsum("bhk,bhkv->bhv", q_t, s, precision=_HIGHEST)
    return s, o_t

  xs = (q, k, v.astype(f32), g.astype(f32), beta.astype(f32), reset)
  xs = tuple(jnp.moveaxis(x, 1, 0) for x in xs)  # time-major for the scan
  state, o = jax.lax.scan(step, state, xs)
  o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
  return o, (state if output_final_state else None)
