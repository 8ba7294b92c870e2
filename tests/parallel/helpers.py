"""Shared pieces of the parallel tests: meshes on the 8 simulated CPU devices."""

import jax

from hybridmoe_jax.parallel.mesh import build_mesh


def make_mesh(**sizes):
  """A mesh of all 8 devices: the given {axis: size}, the other axes of size 1."""
  assert len(jax.devices()) == 8, "tests/conftest.py must force 8 CPU devices"
  return build_mesh(sizes)
