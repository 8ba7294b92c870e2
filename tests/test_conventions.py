"""Source conventions of the tests and benchmarks, checked with `ast`:

- no test module imports a _private name from another test module (shared test code lives in
  tests/_support.py or a helpers module, under a public name);
- no test module defines its own relative-error helper: tests/_support.py has rel_err,
  rel_rms and assert_close, with one (got, want) argument order;
- benchmarks time through benchmarks/_timing.py, never time.perf_counter /
  time.time / time.monotonic directly.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "tests" / "_support.py"
REL_ERR_NAME = re.compile(r"_?(max_)?(rel|err)(_(err|error|rms|max))?")
CLOCKS = {"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns"}
# benchmark file -> why it may read a clock itself
CLOCK_ALLOWED: dict[str, str] = {"_timing.py": "it is the benchmarks' clock"}


def _trees(folder: str):
  for path in sorted((ROOT / folder).rglob("*.py")):
    yield path, ast.parse(path.read_text(), str(path))


def test_no_private_imports_across_test_modules():
  bad = []
  for path, tree in _trees("tests"):
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
        bad += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                for a in node.names if a.name.startswith("_")]
  assert not bad, "private names imported from another test module:\n" + "\n".join(bad)


def test_no_local_rel_err_helpers():
  bad = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
         for path, tree in _trees("tests") if path != SUPPORT
         for node in ast.walk(tree)
         if isinstance(node, ast.FunctionDef)
         and (REL_ERR_NAME.fullmatch(node.name) or node.name in ("rel_rms", "assert_close"))]
  assert not bad, "use tests/_support.py's rel_err / rel_rms / assert_close:\n" + "\n".join(bad)


def test_benchmarks_time_through_timing_module():
  bad = []
  for path, tree in _trees("benchmarks"):
    if path.name in CLOCK_ALLOWED:
      continue
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr in CLOCKS
          and isinstance(node.value, ast.Name) and node.value.id == "time"):
        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} time.{node.attr}")
      if isinstance(node, ast.ImportFrom) and node.module == "time":
        bad += [f"{path.relative_to(ROOT)}:{node.lineno} from time import {a.name}"
                for a in node.names if a.name in CLOCKS]
  assert not bad, "time through benchmarks/_timing.py:\n" + "\n".join(bad)
