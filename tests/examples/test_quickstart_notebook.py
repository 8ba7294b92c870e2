"""examples/quickstart.ipynb runs top to bottom in a fresh kernel, so it can never rot.

The kernel imports this checkout's package (PYTHONPATH), sees one CPU device and the suite's
XLA settings (it inherits the test environment); the notebook trains 200 steps of a 2-layer
tiny model, so this is the suite's one minute-long test (about 45 s of CPU on 2 cores).
"""

import os
import pathlib
import re

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".benchmarks"}


def _repo_files() -> set[str]:
  out = set()
  for d, dirs, files in os.walk(ROOT):
    dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
    out.update(os.path.relpath(os.path.join(d, f), ROOT) for f in files)
  return out


def _text(nb) -> str:
  """Every stream and text/plain output, in order."""
  parts = []
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
  return "\n".join(parts)


def test_notebook_is_committed_without_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_notebook_runs_trains_plots_generates_and_writes_nothing_into_the_repo():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  before = _repo_files()
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute(env=env)     # raises CellExecutionError (with the traceback) on any error
  assert _repo_files() == before
  text = _text(nb)
  first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) in 200 steps", text).groups())
  assert last < first - 2.0, (first, last)
  pngs = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
  assert len(pngs) == 3                       # loss curve, expert load, NIAH grid
  assert "LoadedModel(workdir" in text and "'Return the ' -> '" in text
  sizes = re.findall(r"tiny \(fp32\)\s+[\d,]+\s+([\d.]+) MiB\s+([\d.]+) MiB", text)
  assert len(sizes) == 3 and len({k for k, _ in sizes}) == 1          # KDA state: constant
  mla = [float(m) for _, m in sizes]
  assert abs(mla[2] / mla[0] / 256 - 1) < 0.02                    # MLA cache: linear
  bpb = [float(x) for x in re.findall(r"([\d.]+) bits/byte, perplexity", text)]
  assert len(bpb) == 2 and bpb[0] < bpb[1]    # in-domain text beats shuffled characters
  assert re.search(r"NIAH accuracy [\d.]+ \(chance", text)
  assert "removed " in text
