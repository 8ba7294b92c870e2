"""Every "DESIGN sX" reference in the code names a section heading of docs/DESIGN.md."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# "DESIGN s1.3b", "DESIGN.md s4.2", "(DESIGN s9b)": the section id after an "s".
REF = re.compile(r"DESIGN(?:\.md)?[ ,]{1,2}s(\d+[a-z]?(?:\.\d+[a-z]?)?)\b")
HEADING = re.compile(r"^#{2,3} (\d+[a-z]?(?:\.\d+[a-z]?)?)\.? ", re.M)
SOURCES = ("hybridmoe_jax", "pallas_kernels", "configs", "benchmarks", "tests", "docs")


def _sections() -> set[str]:
  return set(HEADING.findall((ROOT / "docs" / "DESIGN.md").read_text()))


def _references() -> dict[str, list[str]]:
  refs: dict[str, list[str]] = {}
  files = [p for d in SOURCES for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md")]
  files += list(ROOT.glob("*.py")) + list(ROOT.glob("*.md"))
  for path in files:
    if path.name == "DESIGN.md" or path == pathlib.Path(__file__).resolve():
      continue
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
      for sec in REF.findall(line):
        refs.setdefault(sec, []).append(f"{path.relative_to(ROOT)}:{n}")
  return refs


def test_design_sections_parse():
  sections = _sections()
  # The spec's top-level parts and the subsections the code cites most.
  assert {"0", "1", "1.1", "1.3b", "2", "3", "4", "4.2", "9", "9b", "10"} <= sections


def test_every_design_reference_resolves():
  sections, refs = _sections(), _references()
  assert refs, "no DESIGN references found: the pattern no longer matches the code"
  missing = {sec: where for sec, where in refs.items() if sec not in sections}
  assert not missing, f"DESIGN references with no section in docs/DESIGN.md: {missing}"


def test_a_wrong_reference_is_caught():
  assert REF.findall("see DESIGN s12.7 here") == ["12.7"]
  assert "12.7" not in _sections()
