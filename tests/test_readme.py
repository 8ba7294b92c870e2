"""Every ```bash command of README.md works as written.

Fast (`test_readme_commands_refer_to_what_exists`): every command parses as one shell
command; its script or module exists; each --flag it passes is defined by that CLI;
--config files and --config.<field> overrides exist; every path it reads is made by an
earlier README command (a run's --workdir, an export, a written file), is in the repo, or is
one of the user's own inputs named in EXTERNAL; `pip install` extras exist in pyproject.

Slow (`test_readme_commands_run`): the commands run in order in a scratch directory (the
repo's scripts, configs and tests linked in), each with the small overrides of `OVERRIDES`
appended (a training run of 2 steps, evals of a few samples). Commands that cannot run here
are skipped with the reason (a server, a placeholder `...`, an optional extra that is not
installed, a download); the user's own inputs are stand-ins made by `SETUP`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
# Inputs the README expects the user to bring (not made by any command): why.
EXTERNAL = {
    "Kimi-Linear-48B-A3B-Instruct": "the released model's Hugging Face directory (download)",
    "my.jsonl": "the user's own text",
}
# Commands that set up the environment the others run in (the install line): why skipped.
ENVIRONMENT = {"python3.12": "creates the virtual environment (the suite runs inside one)",
               ".": "activates the virtual environment"}
# Absl's own flags, accepted by every absl CLI.
ABSL_FLAGS = {"helpfull", "help", "helpshort", "verbosity", "v", "logtostderr",
              "alsologtostderr", "log_dir", "flagfile"}
TRAIN_SMALL = ["--config.train.steps=2", "--config.train.batch_size=2",
               "--config.train.seq_len=64", "--config.train.eval_batches=1",
               "--config.train.checkpoint_every=0", "--sample_tokens=4"]
RL_SMALL = ["--config.rl.sft_steps=2", "--config.rl.iterations=1", "--config.rl.group_size=2",
            "--config.rl.rollout_batch=2", "--config.rl.sft_batch=2", "--config.rl.minibatches=1",
            "--config.rl.eval_episodes=2", "--config.rl.promote_min_episodes=1"]
EVAL_SMALL = ["--niah_lengths=128", "--niah_depths=0.5", "--niah_samples=1", "--niah_digits=2",
              "--mqar_lengths=64", "--mqar_pairs=4", "--mqar_samples=1", "--ppl_max_docs=1",
              "--ppl_max_len=64", "--max_new_tokens=4", "--vqa_images=2", "--agent_episodes=1",
              "--agent_levels=0"]
# (regex on the command, args appended): the first match wins.
OVERRIDES = [
    (r"run_train\.py .*configs/rl_tiny\.py", TRAIN_SMALL[:-1] + RL_SMALL),
    (r"run_train\.py(?!.*--dry_run)(?!.*--print_config)", TRAIN_SMALL),
    (r"run_eval\.py", EVAL_SMALL),
]


@dataclasses.dataclass
class Command:
  text: str                 # as written (continuations joined, comment cut)
  argv: list[str]           # shell words (no leading VAR=value)
  line: int                 # README line number

  @property
  def placeholder(self) -> bool:
    return "..." in self.argv

  def program(self) -> str:
    """'run_train.py', 'hybridmoe_jax.convert' (python -m), 'pip', 'python -c', ..."""
    a = self.argv
    if a[0] == "python" and len(a) > 1:
      if a[1] == "-m":
        return a[2]
      if a[1] == "-c":
        return "python -c"
      return a[1]
    return a[0]

  def flags(self) -> dict[str, str | None]:
    """--name[=value] (and `--name value` for argparse CLIs) -> value."""
    out, a, i = {}, self.argv, 0
    if "--" in a:   # what follows a bare `--` is another program's argv (a launch recipe's)
      a = a[:a.index("--")]
    while i < len(a):
      if a[i].startswith("--"):
        name, eq, value = a[i][2:].partition("=")
        if not eq and i + 1 < len(a) and not a[i + 1].startswith("-") and not (
            self.program().endswith(".py")):
          value, i = a[i + 1], i + 1
        out[name] = value if (eq or value) else None
      i += 1
    return out


def _cut_comment(line: str) -> str:
  """The line without a trailing `# comment` (a # outside quotes after whitespace)."""
  quote = None
  for i, ch in enumerate(line):
    if quote:
      if ch == "\\" and quote != "'":
        continue
      if ch == quote:
        quote = None
    elif ch in "'\"":
      quote = ch
    elif ch == "#" and (i == 0 or line[i - 1].isspace()):
      return line[:i].rstrip()
  return line.rstrip()


def readme_commands() -> list[Command]:
  text = README.read_text(encoding="utf-8")
  out = []
  for m in re.finditer(r"```bash\n(.*?)```", text, re.S):
    first = text[:m.start(1)].count("\n") + 1
    pending, start = "", 0
    for k, raw in enumerate(m.group(1).splitlines()):
      if not pending:
        start = first + k
      line = raw.rstrip()
      if line.endswith("\\"):
        pending += line[:-1] + " "
        continue
      full = _cut_comment(pending + line).strip()
      pending = ""
      if not full:
        continue
      # ANSI-C quoting ($'a\nb') as shlex reads it: a plain single-quoted word.
      words = shlex.split(full.replace("$'", "'"))
      # `a && b`: each part is a command of its own.
      parts = [[]]
      for w in words:
        if w == "&&":
          parts.append([])
        else:
          parts[-1].append(w)
      for part in parts:
        while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", part[0]):
          part.pop(0)
        if part:
          out.append(Command(" ".join(shlex.quote(w) for w in part) if len(parts) > 1
                             else full, part, start))
  return out


# --------------------------------------------------------------------- what the CLIs define
def _source_of(program: str) -> str:
  if program.endswith(".py"):
    return (ROOT / program).read_text(encoding="utf-8")
  spec = importlib.util.find_spec(program)
  assert spec is not None and spec.origin, f"no module {program}"
  origin = spec.origin
  if origin.endswith("__init__.py"):
    main = os.path.join(os.path.dirname(origin), "__main__.py")
    origin = main if os.path.exists(main) else origin
  return open(origin, encoding="utf-8").read()


def defined_flags(program: str) -> set[str] | None:
  """Flags a CLI defines, read from its source (absl DEFINE_*, argparse add_argument, the
  shared --config flag); None when they are another package's (checked when it runs)."""
  if program == "hybridmoe_jax.serve.lm_eval_adapter":
    return None    # lm_eval's own CLI with our model registered
  src = _source_of(program)
  names = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", src))
  names |= {n.lstrip("-") for n in re.findall(r"add_argument\(\s*\"(--\w+)\"", src)}
  names |= set(re.findall(r"add_argument\([^)]*?\"--(\w+)\"", src))
  if "define_config_flag" in src:
    names.add("config")
  if "absl" in src:
    names |= ABSL_FLAGS
  if "argparse" in src:
    names.add("help")
  return names


def config_field_exists(config_file: str, dotted: str) -> bool:
  from hybridmoe_jax.config.flags import load_config_file  # pylint: disable=import-outside-toplevel
  node = load_config_file(str(ROOT / config_file))
  for part in dotted.split("."):
    if not hasattr(node, "keys") or part not in node.keys():
      return False
    node = node[part]
  return True


def _pip_extras(cmd: Command) -> list[str]:
  return [m for w in cmd.argv for m in re.findall(r"\.\[([\w,-]+)\]", w)]


def _produced(commands: list[Command]) -> set[str]:
  """Paths the README's commands make: run workdirs, exports, converted dirs, written files."""
  made = set()
  for c in commands:
    f, prog = c.flags(), c.program()
    if prog == "run_train.py" and "dry_run" not in f and "print_config" not in f:
      made.add(f.get("workdir") or "runs/default")
    for key in ("export_params_to", "to", "to_hf", "output"):
      if f.get(key):
        made.add(f[key])
    if prog == "python -c":
      made |= set(re.findall(r"write_\w+\('([^']+)'", c.argv[2]))
  return made


def _reads(cmd: Command) -> list[str]:
  """Paths a command reads (must exist or be made)."""
  f, out = cmd.flags(), []
  for key in ("workdir", "params", "image", "init_from", "from", "from_hf", "include_path"):
    if key == "workdir" and cmd.program() == "run_train.py":
      continue       # a training run makes its workdir
    if f.get(key):
      out.append(f[key])
  if f.get("model_args"):
    out += re.findall(r"workdir=([^,\s]+)", f["model_args"])
  if "config" in f and f["config"]:
    out.append(f["config"])
  for key, value in f.items():
    if key == "config.data.paths" and value:
      out += re.findall(r"'([^']+)'", value)
  return out


def test_readme_commands_refer_to_what_exists():
  commands = readme_commands()
  assert len(commands) >= 25, [c.text for c in commands]
  made = _produced(commands)
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]
  problems = []
  for c in commands:
    where = f"README.md:{c.line}: {c.text}"
    prog = c.program()
    if prog == "pip":
      problems += [f"{where}: no extra [{e}]" for part in _pip_extras(c)
                   for e in part.split(",") if e not in extras]
      continue
    if prog in ("tensorboard", "pytest") or prog in ENVIRONMENT:
      continue
    if prog == "python -c":
      compile(c.argv[2], where, "exec")
      continue
    if prog.endswith(".py"):
      if not (ROOT / prog).is_file():
        problems.append(f"{where}: no script {prog}")
        continue
    elif importlib.util.find_spec(prog.split(".")[0]) is None or (
        importlib.util.find_spec(prog) is None):
      problems.append(f"{where}: no module {prog}")
      continue
    known = defined_flags(prog)
    config_file = c.flags().get("config") or "configs/tiny.py"
    for name in c.flags():
      if name.startswith("config."):
        if prog == "run_train.py" and not config_field_exists(config_file, name[7:]):
          problems.append(f"{where}: {config_file} has no field {name[7:]}")
      elif known is not None and name.removeprefix("no") not in known and name not in known:
        problems.append(f"{where}: {prog} has no flag --{name}")
    for path in _reads(c):
      if not (path in made or path in EXTERNAL or (ROOT / path).exists()):
        problems.append(f"{where}: reads {path}, which no earlier command makes")
  assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------- paths in the prose
# Where a repo path starts: a README word beginning so (or a top-level file) names the repo.
REPO_PREFIXES = ("hybridmoe_jax/", "configs/", "tests/", "benchmarks/", "docs/", "examples/",
                 "pallas_kernels/", ".ci/")


def _expand(path: str) -> list[str]:
  """`a/{b,c}.py` -> [a/b.py, a/c.py] (nested braces too)."""
  m = re.search(r"\{([^{}]*)\}", path)
  if not m:
    return [path]
  return [q for alt in m.group(1).split(",")
          for q in _expand(path[:m.start()] + alt + path[m.end():])]


def readme_paths() -> list[tuple[int, str]]:
  """(line, path) for every repo path the README names in `code` or as a link target,
  braces expanded; a glob (`kda*.py`) stands for the files it matches."""
  text = README.read_text(encoding="utf-8")
  out = []
  spans = [(m.start(), m.group(1)) for m in re.finditer(r"`([^`\n]+)`", text)]
  spans += [(m.start(), m.group(1)) for m in re.finditer(r"\]\(([^)\s]+)\)", text)
            if not m.group(1).startswith(("http:", "https:", "#"))]
  for start, span in spans:
    for word in re.findall(r"[\w./{},*-]+", span):
      if word.startswith(REPO_PREFIXES) or re.fullmatch(r"[\w-]+\.(py|md|toml)", word):
        line = text[:start].count("\n") + 1
        out += [(line, p.rstrip(".,")) for p in _expand(word)]
  return out


def test_readme_names_only_paths_that_exist():
  paths = readme_paths()
  assert len(paths) >= 40, paths            # the table and the prose name dozens
  missing = [f"README.md:{line}: {p}" for line, p in paths if not list(ROOT.glob(p))]
  assert not missing, "the README names paths that do not exist:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------ running them
def _skip_reason(c: Command) -> str | None:
  prog, f = c.program(), c.flags()
  if c.placeholder:
    return "a placeholder (...) for the user's own flags"
  if prog in ("pip", "pytest", "tensorboard"):
    return {"pip": "installs from the network", "pytest": "the test suite itself",
            "tensorboard": "a server"}[prog]
  if prog in ENVIRONMENT:
    return ENVIRONMENT[prog]
  if prog == "hybridmoe_jax.serve":
    return "a server (tests/serve drives it with the openai client)"
  if prog == "hybridmoe_jax.serve.lm_eval_adapter" and importlib.util.find_spec("lm_eval") is None:
    return "the lm-eval extra is not installed"
  topology = f.get("config.hardware.topology") or ""
  if topology.split(":")[0] in ("h100", "h200"):
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
      return "the GPU AOT compile needs jax's CUDA plugin (.[gpu])"
  elif topology and importlib.util.find_spec("libtpu") is None:
    return "the TPU AOT compile needs libtpu (.[tpu])"
  if "curriculum" in (f.get("config") or "") and "dry_run" not in f:
    return ("a staged curriculum to 64K tokens (stages are not flag-sized; "
            "tests/train/test_curriculum.py trains a small one)")
  return None


def _setup(c: Command, scratch) -> None:
  """Stand-ins for the user's own inputs."""
  f = c.flags()
  if f.get("from_hf") == "Kimi-Linear-48B-A3B-Instruct" and not (
      scratch / "Kimi-Linear-48B-A3B-Instruct").exists():
    # pylint: disable-next=import-outside-toplevel
    from tests.convert.kimi_tiny import tiny_hf_config, write_hf_dir
    # A vocabulary the byte tokenizer fits (the stand-in has no tokenizer of its own).
    write_hf_dir(scratch / "Kimi-Linear-48B-A3B-Instruct", tiny_hf_config(vocab_size=320))
  if "my.jsonl" in (f.get("config.data.paths") or "") or f.get("input") == "my.jsonl":
    lines = [f'{{"text": "document {i}: {"the quick brown fox " * 40}"}}' for i in range(40)]
    (scratch / "my.jsonl").write_text("\n".join(lines) + "\n")


def in_dependency_order(commands: list[Command]) -> list[Command]:
  """README order, except that a command reading what a later one makes (the quick
  reference's `--workdir=runs/rl` before the RL section trains it) runs after its maker."""
  out = list(commands)
  for c in commands:
    reads, here = set(_reads(c)), out.index(c)
    makers = [i for i, m in enumerate(out) if reads & _produced([m])]
    if makers and min(makers) > here:     # made only later: run after its first maker
      out.remove(c)
      out.insert(min(makers), c)          # the maker moved up by one: this is right after it
  return out


def test_dependency_order():
  cmds = readme_commands()
  order = in_dependency_order(cmds)
  assert sorted(c.line for c in order) == sorted(c.line for c in cmds)
  for i, c in enumerate(order):
    made_later = set().union(*[_produced([m]) for m in order[i + 1:]]) if order[i + 1:] else set()
    made_before = set().union(*[_produced([m]) for m in order[:i]]) if i else set()
    assert not (set(_reads(c)) & made_later - made_before), c.text


@pytest.mark.slow
def test_readme_commands_run(tmp_path):
  """The README top to bottom, small (~20-30 min on 2 cores)."""
  for name in ("run_train.py", "run_eval.py", "configs", "tests", "examples", "hybridmoe_jax"):
    (tmp_path / name).symlink_to(ROOT / name)
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  ran, skipped, failed = [], [], []
  for c in in_dependency_order(readme_commands()):
    why = _skip_reason(c)
    if why:
      skipped.append(f"README.md:{c.line}: {c.text} ({why})")
      continue
    _setup(c, tmp_path)
    extra = next((args for pattern, args in OVERRIDES if re.search(pattern, c.text)), [])
    if c.program() == "python -c":
      extra = []
    devices = math.prod(int(v) for k, v in c.flags().items() if k.startswith("config.mesh."))
    if devices > 1:   # simulated on CPU, as the README's next line shows
      shell = f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} {c.text}"
    else:
      shell = c.text
    shell = shell.replace("python ", f"{shlex.quote(sys.executable)} ", 1)
    shell = " ".join([shell] + [shlex.quote(a) for a in extra])
    p = subprocess.run(["bash", "-c", shell], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=1800, input="/exit\n", check=False)
    (ran if p.returncode == 0 else failed).append(
        f"README.md:{c.line}: {shell} -> {p.returncode}\n{p.stderr[-1500:]}")
    print(f"README.md:{c.line}: exit {p.returncode}: {c.text}", flush=True)
  print("\n".join(["skipped:"] + skipped))
  assert not failed, "\n\n".join(failed)
  assert len(ran) >= 15, ran
