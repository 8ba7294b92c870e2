"""Per-channel log-decay gates for KDA (DESIGN s1.2).

Conventions: x: [..., HV, K] gate projection; a_log: [HV]; dt_bias: [HV * K] or [HV, K];
the result g: [..., HV, K] float32 with g <= 0 (the log of the per-channel decay).

    unbounded: g = -exp(a_log) * softplus(x + dt_bias)         range (-inf, 0)
    bounded:   g = lb * sigmoid(exp(a_log) * (x + dt_bias))    range (lb, 0), lb in [-5, 0)

The bounded gate keeps |g| <= 5 per token, which is what lets the chunked kernels turn
every 16-token diagonal block into one dense matmul (see pallas_kernels/kda/chunk_xla.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The factorised diagonal block multiplies exp(+-0.5 * 15 * |lb|) factors; at lb = -5 that is
# e^37.5 each, e^75 for a product: inside fp32's (and bf16's) exponent range with margin.
MIN_LOWER_BOUND = -5.0


def check_lower_bound(lower_bound: float) -> None:
  """Raises ValueError unless lower_bound is a number in [-5, 0)."""
  try:
    if isinstance(lower_bound, (str, bytes)):  # float("-5") parses, but the ops compute with lb
      raise TypeError(lower_bound)
    lb = float(lower_bound)
  except (TypeError, ValueError):
    raise ValueError(
        f"lower_bound must be a float in [{MIN_LOWER_BOUND}, 0), got {lower_bound!r}"
    ) from None
  if not MIN_LOWER_BOUND <= lb < 0.0:
    raise ValueError(f"lower_bound must be in [{MIN_LOWER_BOUND}, 0), got {lower_bound!r}")


def _biased(x: jax.Array, dt_bias: jax.Array | None) -> jax.Array:
  """x [..., HV, K] in float32, plus the per-channel dt_bias ([HV*K] or [HV, K]) if given."""
  x = jnp.asarray(x, jnp.float32)
  if dt_bias is None:
    return x
  hv, k = x.shape[-2:]
  dt_bias = jnp.asarray(dt_bias, jnp.float32)
  # The exact shapes, not just the size: a [K, HV] (transposed) bias has HV*K entries too,
  # and reshaping it to [HV, K] would silently pair channels with the wrong heads.
  if dt_bias.shape not in ((hv * k,), (hv, k)):
    raise ValueError(f"dt_bias must have shape [HV*K] or [HV, K] = [{hv}, {k}], "
                     f"got {dt_bias.shape}")
  return x + dt_bias.reshape(hv, k)


def _per_head(a_log: jax.Array, hv: int) -> jax.Array:
  """exp(a_log) as [HV, 1] float32, broadcast over the K channels of each head."""
  a_log = jnp.asarray(a_log, jnp.float32)
  if a_log.shape != (hv,):
    raise ValueError(f"a_log must have shape [HV] = [{hv}], got {a_log.shape}")
  return jnp.exp(a_log)[:, None]


def bounded_log_decay(x: jax.Array, *, lower_bound: float = -5.0, a_log: jax.Array | None = None,
                      dt_bias: jax.Array | None = None) -> jax.Array:
  """Bounded KDA gate g = lb * sigmoid(exp(a_log) * (x + dt_bias)), in (lb, 0).

  Args:
    x: [..., HV, K] gate projection, any float dtype.
    lower_bound: lb in [-5, 0).
    a_log: optional [HV] per-head log rate; None means rate 1 (g = lb * sigmoid(x + dt_bias)).
    dt_bias: optional [HV*K] or [HV, K] per-channel bias.

  Returns:
    g: [..., HV, K] float32 log decay.

  Raises:
    ValueError: lower_bound outside [-5, 0), or a parameter of the wrong shape.
  """
  check_lower_bound(lower_bound)
  x = _biased(x, dt_bias)
  if a_log is not None:
    x = x * _per_head(a_log, x.shape[-2])
  return jnp.float32(lower_bound) * jax.nn.sigmoid(x)


def unbounded_log_decay(x: jax.Array, *, a_log: jax.Array, dt_bias: jax.Array | None = None
                        ) -> jax.Array:
  """Unbounded KDA gate g = -exp(a_log) * softplus(x + dt_bias), in (-inf, 0).

  Args:
    x: [..., HV, K] gate projection, any float dtype.
    a_log: [HV] per-head log rate.
    dt_bias: optional [HV*K] or [HV, K] per-channel bias.

  Returns:
    g: [..., HV, K] float32 log decay.
  """
  x = _biased(x, dt_bias)
  return -_per_head(a_log, x.shape[-2]) * jax.nn.softplus(x)
