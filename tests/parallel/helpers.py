"""Shared pieces of the parallel tests: meshes on the 8 simulated CPU devices, collective
bytes in compiled HLO."""

import re

import jax
import numpy as np

from hybridmoe_jax.parallel.mesh import build_mesh


def make_mesh(**sizes):
  """A mesh of all 8 devices: the given {axis: size}, the other axes of size 1."""
  assert len(jax.devices()) == 8, "tests/conftest.py must force 8 CPU devices"
  return build_mesh(sizes)


_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter|collective-permute|"
                         r"all-to-all)(?:-start)?\(")
HLO_ARRAY = re.compile(r"\b(f32|f16|bf16|s32|u32|pred|s8|u8)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "pred": 1, "s8": 1, "u8": 1}


def collective_bytes(hlo: str) -> dict[str, int]:
  """Result bytes per collective kind in compiled HLO text."""
  out = {}
  for m in _COLLECTIVE.finditer(hlo):
    size = sum(_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d]))
               for dt, dims in HLO_ARRAY.findall(m.group(1)))
    out[m.group(2)] = out.get(m.group(2), 0) + size
  return out
