"""Shared pieces of the parallel tests: meshes on the 8 simulated CPU devices."""

import jax
import ml_collections

from hybridmoe_jax.parallel.mesh import build_mesh


def mesh_cfg(data=1, fsdp=1, expert=1, tensor=1) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, expert=expert, tensor=tensor))


def make_mesh(**sizes):
  assert len(jax.devices()) == 8, "tests/conftest.py must force 8 CPU devices"
  return build_mesh(mesh_cfg(**sizes))
