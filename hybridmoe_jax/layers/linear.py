"""The one bias-free projection used by every layer: fp32 parameters, compute-dtype matmul."""

from flax import nnx
import jax.numpy as jnp


def linear(d_in: int, d_out: int, *, dtype: str, rngs: nnx.Rngs) -> nnx.Linear:
  """nnx.Linear without bias, kernel [d_in, d_out] fp32 ~ N(0, 1/d_in)."""
  return nnx.Linear(d_in, d_out, use_bias=False, dtype=jnp.dtype(dtype),
                    param_dtype=jnp.float32,
                    kernel_init=nnx.initializers.normal(stddev=d_in ** -0.5), rngs=rngs)
