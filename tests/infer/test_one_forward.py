"""Inference reuses the model's forward: it neither re-implements mixer math nor reads
layer parameters (which would silently diverge from training when a layer changes)."""

import ast
import pathlib
import re

PKG = pathlib.Path(__file__).resolve().parents[2] / "hybridmoe_jax"


def _imports(path):
  names = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      names += [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names += [a.name for a in node.names]
  return names


def test_infer_imports_no_math():
  """infer/ reaches the model only through hybridmoe_jax.model (no ops, no layers)."""
  for path in sorted((PKG / "infer").glob("*.py")):
    for name in _imports(path):
      assert not name.startswith(("hybridmoe_jax.ops", "hybridmoe_jax.layers")), (path.name, name)


def test_no_layer_internals_outside_layers():
  pattern = re.compile(r"\.(kernel|weight)\b")
  for path in sorted(PKG.rglob("*.py")):
    # data/ cannot import layers (its `.weight` are mixture weights of data components);
    # convert/ maps checkpoint tensor names ("...q_proj.weight" strings), never modules.
    if path.parent.name in ("layers", "data", "convert"):
      continue
    for i, line in enumerate(path.read_text().splitlines(), 1):
      assert not pattern.search(line), f"{path.relative_to(PKG)}:{i}: {line.strip()}"
