"""Import layering of hybridmoe_jax (and pallas_kernels), checked from the source with `ast`.

Ranks (a module may import modules of its own group or of a lower rank only):
  0 config (the typed config tree: model, run, rl, hardware, sharding axes, the CLIs' --config
    flag), plots (figures: numpy + matplotlib only), io (file formats: numpy + json)
  0.5 cli (command-line plumbing: terminal output, one-line errors, signals, the workdir
    lock; every CLI and the train, evals, convert and rl runs use it, it imports config only)
    pallas_kernels (the kernel library, importable with jax alone: it imports nothing from
    hybridmoe_jax; the ops call it and may use its XLA math, e.g. ops.kda.chunked)
  1 ops
  2 layers   3 model   4 parallel   5 train, infer (never each other)   6 evals, convert
    (Hugging Face interop), rl (agentic RL: environments, sandbox, chat format), loading
    (loading.py, the one model loader: a run, an export or an HF dir -> model + tokenizer)
  7 tools (tools/: describe, aot, agent_eval), api.py (`load`) and launch/ (the
    cluster recipes); they may import everything, and no package module may import them.
  8 serve: apps built on the `load` API (the OpenAI server, the chat REPL, the lm-eval
    adapter); they may import tools, nothing imports them.
data: imports only config and data; only train, infer, evals and the tools
  (rank >= 5) import it.
__init__ modules belong to their package (same group, same rules); the root
  hybridmoe_jax/__init__.py loads its public names lazily and imports nothing.
Every import statement counts, function-level ones included; `from pkg import name` is an
import of the submodule pkg.name when that module exists, else of pkg. Besides the ranks,
the module graph must have no import cycle.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("hybridmoe_jax", "pallas_kernels")
RANKS = {"config": 0, "plots": 0, "io": 0, "cli": 0.5, "pallas_kernels": 0.5, "ops": 1,
         "layers": 2,
         "model": 3, "parallel": 4, "train": 5, "infer": 5, "evals": 6, "convert": 6, "rl": 6,
         "loading": 6,
         "tools": 7, "api": 7, "launch": 7, "serve": 8}
TOOLS_RANK = 7
DATA_IMPORTS = {"config", "data"}
DATA_IMPORTERS_MIN_RANK = 5
SIBLINGS_APART = {frozenset({"train", "infer"})}


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> source file, for every .py file of the checked packages."""
  out = {}
  for pkg in PACKAGES:
    for path in sorted((ROOT / pkg).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts.pop()
      out[".".join(parts)] = path
  return out


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
  """The checked-package modules that `name` imports anywhere in its source."""
  is_pkg = path.name == "__init__.py"
  here = name.split(".") if is_pkg else name.split(".")[:-1]
  found = set()

  def add(target: str, names=()):
    if target.split(".")[0] not in PACKAGES:
      return
    subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
    if subs:
      found.update(subs)
    if len(subs) < len(names) or not names:
      # A name that is not a submodule comes from the package (or module) itself.
      while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
      found.add(target)

  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        add(alias.name)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = here[:len(here) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
      else:
        target = node.module
      add(target, tuple(a.name for a in node.names if a.name != "*"))
  found.discard(name)
  return found


def _group(name: str) -> str:
  """hybridmoe_jax.layers.moe -> "layers"; hybridmoe_jax.tools.describe -> "describe";
  hybridmoe_jax -> "__root__"; pallas_kernels.* -> "pallas_kernels"."""
  parts = name.split(".")
  if parts[0] == "pallas_kernels":
    return "pallas_kernels"
  return parts[1] if len(parts) > 1 else "__root__"


def _rank(group: str) -> int | None:
  """None for data (its own rules) and the root package; a new top-level module needs a rank."""
  if group in ("data", "__root__"):
    return None
  return RANKS[group]


def _violation(src: str, dst: str) -> str | None:
  a, b = _group(src), _group(dst)
  if a == b:
    return None
  if a == "__root__":
    return "the root __init__ must import nothing (its names load lazily)"
  if b == "__root__":
    return None                                   # `import hybridmoe_jax`: imports nothing
  if a == "data":
    return None if b in DATA_IMPORTS else f"data may import only {sorted(DATA_IMPORTS)}"
  ra, rb = _rank(a), _rank(b)
  if b == "data":
    return (None if ra >= DATA_IMPORTERS_MIN_RANK
            else f"only rank >= {DATA_IMPORTERS_MIN_RANK} (train, infer, evals, tools) "
                 "may import data")
  if frozenset({a, b}) in SIBLINGS_APART:
    return f"{a} and {b} must not import each other"
  if rb == TOOLS_RANK and ra < TOOLS_RANK:
    return f"tool {b} is not importable from the package"
  if rb > ra:
    return f"{a} (rank {ra}) may not import {b} (rank {rb})"
  return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan, iterative)."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  counter = 0
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = counter
    counter += 1
    stack.append(root)
    on_stack.add(root)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter
          counter += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph[child]))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        comp = []
        while True:
          top = stack.pop()
          on_stack.discard(top)
          comp.append(top)
          if top == node:
            break
        if len(comp) > 1:
          out.append(sorted(comp))
  return out


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_import_ranks_and_no_cycles():
  graph = _graph()
  problems = [f"{src} -> {dst}: {why}" for src in sorted(graph) for dst in sorted(graph[src])
              if (why := _violation(src, dst))]
  problems += [f"import cycle: {' <-> '.join(c)}" for c in _cycles(graph)]
  assert not problems, f"{len(problems)} layering violation(s):\n" + "\n".join(problems)


def test_plots_import_no_other_package_module():
  """plots draws plain numbers: it must not pull jax or the model in through rank 0."""
  graph = _graph()
  outside = {f"{src} -> {dst}" for src in graph if _group(src) == "plots"
             for dst in graph[src] if _group(dst) != "plots"}
  assert not outside, outside


def test_the_checker_sees_every_kind_of_import(tmp_path):
  """The parser finds absolute, relative, function-level and submodule imports, and the
  rules flag what they forbid (else the test above could pass by seeing nothing)."""
  modules = _modules()
  src = tmp_path / "moe.py"
  src.write_text("import jax\nfrom hybridmoe_jax.config import sharding\nfrom ..ops.glu import get_glu\n"
                 "from . import norms\n\ndef f():\n  from hybridmoe_jax.parallel import ep_moe\n"
                 "  import hybridmoe_jax.model.decoder\n")
  got = _imports("hybridmoe_jax.layers.moe", src, modules)
  assert got == {"hybridmoe_jax.config.sharding", "hybridmoe_jax.ops.glu", "hybridmoe_jax.layers.norms",
                 "hybridmoe_jax.parallel.ep_moe", "hybridmoe_jax.model.decoder"}, got
  assert "hybridmoe_jax.ops.glu" in _graph()["hybridmoe_jax.ops"]      # an __init__'s imports
  for src_mod, dst in [("hybridmoe_jax.layers.moe", "hybridmoe_jax.parallel.ep_moe"),
                       ("hybridmoe_jax.train.step", "hybridmoe_jax.infer.engine"),
                       ("hybridmoe_jax.data.pipeline", "hybridmoe_jax.ops.glu"),
                       ("hybridmoe_jax.model.decoder", "hybridmoe_jax.data.tokenizers.load"),
                       ("hybridmoe_jax.ops.kda", "hybridmoe_jax.tools.describe"),
                       ("hybridmoe_jax", "hybridmoe_jax.config")]:
    assert _violation(src_mod, dst), (src_mod, dst)
  assert not _violation("hybridmoe_jax.train.step", "hybridmoe_jax.data.tokenizers.load")
  assert not _violation("hybridmoe_jax.loading", "hybridmoe_jax.train.state")
  assert not _violation("hybridmoe_jax.ops.kda", "pallas_kernels.kda")
  assert _violation("pallas_kernels.kda.prep", "hybridmoe_jax.ops.kda.chunked")
  assert _violation("pallas_kernels.kda.api", "hybridmoe_jax.ops.kda.api")
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_pallas_kernels_import_nothing_from_hybridmoe_jax():
  """pallas_kernels is a standalone kernel library (jax alone): the ops choose and call its
  backends, it never reaches back (no module of it imports hybridmoe_jax, not even config)."""
  graph = _graph()
  kernels = [m for m in graph if _group(m) == "pallas_kernels"]
  assert "pallas_kernels.kda.api" in kernels  # the check sees the kernel modules
  bad = [f"{src} -> {dst}" for src in kernels for dst in graph[src]
         if dst.split(".")[0] == "hybridmoe_jax"]
  assert not bad, bad


def test_nothing_outside_tests_imports_the_test_package():
  """tests/conftest.py sets compile flags for speed (most XLA optimisations off, 8 simulated
  devices): a benchmark or tool importing it would time, and report, those programs."""
  bad = []
  for path in sorted(ROOT.glob("*.py")) + sorted(
      p for d in ("benchmarks", "examples", *PACKAGES) for p in (ROOT / d).rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:   # relative: same package
        names = [node.module]
      else:
        continue
      bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "tests"]
  assert not bad, bad


def test_layers_reach_parallel_and_kernels_only_through_the_plan_and_ops():
  """layers/ has one code path: no runner (parallel) or kernel package (pallas_kernels) in
  its imports; where an op runs is the execution plan's (`ops.plan`) and the op's choice."""
  graph = _graph()
  bad = [f"{src} -> {dst}" for src in graph if _group(src) == "layers" for dst in graph[src]
         if _group(dst) in ("parallel", "pallas_kernels")]
  assert not bad, bad


def _calls(path: pathlib.Path, names: set[str]) -> list[int]:
  """Lines of `path` calling one of `names` ("f" or "module.f"; docstrings and comments do
  not count)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Call):
      f = node.func
      name = (f.id if isinstance(f, ast.Name) else f"{f.value.id}.{f.attr}"
              if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else "")
      if name in names:
        out.append(node.lineno)
  return out


def _callers(names: set[str], allowed_dirs: tuple[str, ...], allowed_files: set[str]):
  bad = []
  for path in sorted((ROOT / "hybridmoe_jax").rglob("*.py")):
    rel = path.relative_to(ROOT / "hybridmoe_jax").as_posix()
    if rel.split("/")[0] in allowed_dirs or rel in allowed_files:
      continue
    bad += [f"{rel}:{line}" for line in _calls(path, names)]
  return bad


def test_models_and_graphdefs_are_built_in_few_places():
  """One graph per model: HybridLM is constructed, and split into a graphdef, in model/,
  train/ and these named loaders only (a second graph of the same model, e.g. for rollouts,
  is what the execution plan replaced)."""
  built = {"api.py", "loading.py", "rl/evaluate.py", "tools/aot.py"}
  assert not _callers({"HybridLM"}, ("model", "train"), built)
  assert _calls(ROOT / "hybridmoe_jax/train/state.py", {"HybridLM"})  # the check sees them
  split = {"api.py", "loading.py", "convert/convert.py", "infer/engine.py", "rl/trainer.py",
           "tools/aot.py"}
  assert not _callers({"nnx.split", "split_model"}, ("model", "train"), split)


def test_gradients_are_taken_in_train_only():
  """Every gradient goes through train/ (the step and its swappable loss; RL's objective is
  a loss_fn of `train.step.make_train_step`)."""
  grads = {f"{m}.{f}" for m in ("jax", "nnx") for f in ("grad", "value_and_grad")}
  assert not _callers(grads, ("train",), set())
  assert _calls(ROOT / "hybridmoe_jax/train/step.py", grads)   # the check sees them
