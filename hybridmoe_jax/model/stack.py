"""The scanned layer stack (`compute.scan_layers`): which layers repeat, and the state layouts.

With scan_layers the decoder keeps the layers that repeat as STACKED parameters and runs
them with one `jax.lax.scan` (`model.decoder`), so compile time no longer grows with depth.
The repeating unit is one period P of `cfg.layer_kinds` (3 KDA + 1 MLA: P = 4). Layers that
break the pattern stay unscanned, in order: the leading whole periods that hold a dense-FFN
layer (`cfg.moe.first_dense_layers`) and the tail after the last whole period.
  Kimi-Linear-48B (27 layers, MLA at 1-based 4, 8, ..., 24 and 27, layer 0 dense):
    prefix 0-3, scanned 4-23 (5 repeats of 4), tail 24-26.
  K3 (93 layers): prefix 0-3, scanned 4-91 (22 repeats), tail 92.

State layouts (`stack_state` / `unstack_state` convert, exact inverses):
  per-layer  {"layers": {i: layer_i}, ...}, every layer i at "layers/<i>";
  stacked    {"layers": {i: layer_i for the unscanned i}, "stack": {j: stacked_j}, ...}:
             stacked_j holds layers split.index(r, j), r = 0..R-1, each leaf [R, ...].
Both hold the same arrays; a checkpoint or a params export of one layout loads into a model
of the other after the conversion (params, routing biases, optimizer moments: any tree
shaped like the model's state, and aux["moe"]).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hybridmoe_jax.config import ModelConfig

STACK = "stack"     # the state key of the stacked layers: "stack/<j>/..." (j < period)
LAYERS = "layers"   # the per-layer key: "layers/<i>/..."
# A leaf or module path inside the stacked layers (optimizer moments prefix theirs).
_STACKED_PATH = re.compile(rf"(^|/){STACK}/(\d+)(/|$)")


class LayerSplit(NamedTuple):
  """Layers [0, start) and [end, num_layers) unscanned; [start, end) = R repeats of P."""

  num_layers: int
  period: int    # P: layers per repeat (0: no repeating unit)
  start: int     # the first scanned layer
  repeats: int   # R: 0 -> nothing is scanned

  @property
  def end(self) -> int:
    return self.start + self.period * self.repeats

  @property
  def scanned(self) -> range:
    return range(self.start, self.end)

  def index(self, r, j: int):
    """The original layer index of position j of repeat r (r may be traced)."""
    return self.start + r * self.period + j


def find_period(kinds: tuple[str, ...]) -> int:
  """The smallest P such that `kinds` is >= 2 whole copies of kinds[:P] followed by a tail
  shorter than P (e.g. "kkkm" x 6 + "kkm" -> 4); 0 if there is none (e.g. "kkkm")."""
  n = len(kinds)
  for p in range(1, n // 2 + 1):
    copies = 1
    while (copies + 1) * p <= n and kinds[copies * p:(copies + 1) * p] == kinds[:p]:
      copies += 1
    if copies >= 2 and n - copies * p < p:
      return p
  return 0


def layer_split(cfg: ModelConfig) -> LayerSplit:
  """Which layers a scanned stack runs: whole periods after the leading ones that hold a
  dense-FFN layer, up to the last whole period (see the module docstring)."""
  n, p = cfg.num_layers, find_period(tuple(cfg.layer_kinds))
  if not p:
    return LayerSplit(n, 0, n, 0)
  whole = n // p
  # Whole leading periods that hold a dense layer stay out: every scanned layer is MoE (one
  # FFN kind per stacked position).
  dense_groups = -(-cfg.moe.first_dense_layers // p)
  repeats = max(whole - dense_groups, 0)
  return LayerSplit(n, p, dense_groups * p if repeats else n, repeats)


def stacked_position(path: str) -> int | None:
  """j of a path inside the stacked layers ("stack/<j>/ffn/w_up", also under an optimizer
  moment's prefix), else None."""
  m = _STACKED_PATH.search(path)
  return None if m is None else int(m.group(2))


def unstacked_name(cfg: ModelConfig, path: str, r: int) -> str:
  """A stacked module path of repeat r -> the per-layer path ("stack/1/ffn", r=2 ->
  "layers/<index(2, 1)>/ffn"): the names metrics and plots use whatever the layout."""
  j = stacked_position(path)
  if j is None:
    return path
  i = layer_split(cfg).index(r, j)
  return _STACKED_PATH.sub(lambda m: f"{m.group(1)}{LAYERS}/{i}{m.group(3)}", path, count=1)


# ---------------------------------------------------------------------- layout conversion
def _key(mapping: Mapping, i: int):
  """The key of entry i: an int (nnx states) or its string (orbax, safetensors exports)."""
  return i if i in mapping or str(i) not in mapping else str(i)


def _plain(tree):
  """An nnx.State (or any mapping) as nested plain dicts, the leaves untouched: the layout
  nnx.State keeps inside itself, so the rebuilt State has the model state's treedef."""
  if isinstance(tree, nnx.State):
    tree = tree.raw_mapping
  if isinstance(tree, Mapping):
    return {k: _plain(v) for k, v in tree.items()}
  return tree


def _rebuild(state, tree: dict):
  """`tree` (a plain dict) as the container type of `state`."""
  return nnx.State(tree) if isinstance(state, nnx.State) else tree


def _stack(trees: list):
  """Trees of equal structure -> one tree whose leaves are stacked on a new leading axis."""
  return jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *trees)


def stack_state(state: Mapping, cfg: ModelConfig):
  """Per-layer layout -> stacked layout (`layer_split(cfg)`), same container type.

  Args:
    state: a model-shaped tree (nnx.State or nested dicts; int or str layer keys):
      parameters, routing biases, an optimizer moment, aux["moe"]. It may hold only some
      layers (the MoE ones); it must hold all of the scanned ones or none.
  Returns:
    The same tree with layers `split.scanned` moved into "stack/<j>" (leaves [R, ...],
    jnp arrays); unchanged if nothing is scanned or the tree has no such layer.
  Raises:
    ValueError: the tree holds some scanned layers but not all, or is stacked already.
  """
  split, given = layer_split(cfg), state
  state = _plain(state)
  layers = state.get(LAYERS, {})
  keys = [_key(layers, i) for i in split.scanned]
  present = [k in layers for k in keys]
  if not any(present):
    return given
  if STACK in state or not all(present):
    what = "a stack already" if STACK in state else "only some of the scanned layers"
    raise ValueError(f"stack_state: the tree holds {what} (scanned: layers "
                     f"{split.start}-{split.end - 1})")
  scanned = set(keys)
  out = {k: v for k, v in state.items() if k != LAYERS}
  rest = {k: v for k, v in layers.items() if k not in scanned}
  if rest:
    out[LAYERS] = rest
  as_int = isinstance(keys[0], int)
  out[STACK] = {(j if as_int else str(j)): _stack([layers[_key(layers, split.index(r, j))]
                                                   for r in range(split.repeats)])
                for j in range(split.period)}
  return _rebuild(given, out)


def unstack_state(state: Mapping, cfg: ModelConfig):
  """Stacked layout -> per-layer layout: `stack_state`'s exact inverse (leaves sliced on
  their leading axis; layers in index order). Unchanged if the tree has no stack."""
  if STACK not in state:
    return state
  split, given = layer_split(cfg), state
  state = _plain(state)
  stack = state[STACK]
  as_int = any(isinstance(k, int) for k in stack)
  layers = dict(state.get(LAYERS, {}))
  for j in range(split.period):
    sub = stack[_key(stack, j)]
    for r in range(split.repeats):
      i = split.index(r, j)
      layers[i if as_int else str(i)] = jax.tree.map(lambda a, r=r: a[r], sub)
  out = {k: v for k, v in state.items() if k not in (LAYERS, STACK)}
  out[LAYERS] = dict(sorted(layers.items(), key=lambda kv: int(kv[0])))
  return _rebuild(given, out)


def layout_hint(want: Mapping[str, Any], got: Mapping[str, Any]) -> str:
  """A sentence when two model-shaped trees differ by the stack layout (one has "stack",
  the other not), else ""."""
  if (STACK in want) == (STACK in got):
    return ""
  have, need = ("stacked", "per-layer") if STACK in got else ("per-layer", "stacked")
  return (f" The stored tree is in the {have} layout and this model's in the {need} one "
          f"(compute.scan_layers): set compute.scan_layers to match, or convert with "
          f"hybridmoe_jax.model.stack.{'unstack_state' if STACK in got else 'stack_state'}.")
