"""Gated linear units of the expert FFNs (DESIGN s4.1).

Conventions: g, u: [..., I] (gate and up projections, any float dtype); the result is fp32.
SiTU-GLU bounds both branches, |f| <= 4 * 25 = 100, so a bf16 expert cannot blow up;
SwiGLU is the unbounded baseline.
"""

from __future__ import annotations

from typing import Callable, Literal

import jax
import jax.numpy as jnp

GLUKind = Literal["situ", "swiglu"]

# SiTU-GLU soft caps: the gate branch 4*tanh(g/4)*sigmoid(g) lies in (-0.27, 4) (like silu,
# whose minimum is -0.28), the up branch 25*tanh(u/25) in (-25, 25).
_GATE_CAP = 4.0
_UP_CAP = 25.0


def situ_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """Bounded GLU: f = 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25), |f| <= 100.

  Near zero tanh(x/c) * c ~ x, so situ_glu(g, u) ~ g sigmoid(g) u = swiglu(g, u).

  Args:
    gate: g = x W_gate, [..., I], any float dtype.
    up: u = x W_up, [..., I], same shape.

  Returns:
    [..., I] float32.
  """
  g = gate.astype(jnp.float32)
  u = up.astype(jnp.float32)
  gated = _GATE_CAP * jnp.tanh(g / _GATE_CAP) * jax.nn.sigmoid(g)
  return gated * (_UP_CAP * jnp.tanh(u / _UP_CAP))


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """SwiGLU: f = silu(g) * u = g sigmoid(g) u, computed and returned in float32.

  Args:
    gate: [..., I], any float dtype.
    up: [..., I], same shape.

  Returns:
    [..., I] float32.
  """
  g = gate.astype(jnp.float32)
  return jax.nn.silu(g) * up.astype(jnp.float32)


_GLUS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "situ": situ_glu,
    "swiglu": swiglu,
}


def get_glu(kind: GLUKind) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """The GLU function named `kind` ("situ" or "swiglu")."""
  if kind not in _GLUS:
    raise ValueError(f"unknown glu {kind!r}: allowed {sorted(_GLUS)}")
  return _GLUS[kind]
