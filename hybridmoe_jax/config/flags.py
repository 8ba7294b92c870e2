"""Config files: `load_config_file` (a preset's ConfigDict) and the `--config` flag of the
CLIs, with one-line errors for a bad file or override.

ml_collections reads `--config=<file>` and every `--config.a.b=v` override while absl parses
the command line: at flag definition for the default file, inside `app.run` otherwise. Both
places raise raw exceptions (a 50-line traceback for `--config.train.stepz=5`). The CLIs
define the flag with `define_config_flag` and pass `parse_flags` to `app.run`, so either way
the user reads one line naming the flag and, for a misspelt field, the likely intended one.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from absl import flags
import ml_collections
import yaml
from ml_collections import config_flags

from hybridmoe_jax.config import MOVED, ConfigError, ModelConfig, model_config_from_dict


def load_config_file(path: str | os.PathLike) -> ml_collections.ConfigDict:
  """`get_config()` of a config file such as configs/tiny.py (presets build on each other;
  the root ones on `run_config.default_config()`)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path} does not exist")
  name = "_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def load_model_config(path: str) -> ModelConfig:
  """The `model` section of a configs/*.py file (its get_config()): what a loaded model must
  match (run_eval.py's --config). ValueError naming the flag for a missing file."""
  if not os.path.isfile(path):
    raise ValueError(f"--config file {path} does not exist")
  return model_config_from_dict(load_config_file(path).model)


def _plain(value):
  """A config value as plain YAML types: dicts, lists (tuples too), scalars; anything else
  as its str (so safe_dump never writes a !!python tag)."""
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  return str(value)


def config_yaml(config: ml_collections.ConfigDict, source: str,
                overrides: list[str] | tuple[str, ...] = ()) -> str:
  """`--print_config`'s text: a comment naming the config file and the --config.* overrides,
  then every field as plain YAML (tuples as lists, no !!python tags: any YAML reader and a
  person read it the same)."""
  head = [f"# config file: {source}"]
  if overrides:
    head.append("# overrides: " + " ".join(overrides))
  body = yaml.safe_dump(_plain(config.to_dict()), sort_keys=True, default_flow_style=False)
  return "\n".join(head) + "\n" + body


def config_flag_error(error: BaseException, argv: list[str]) -> str:
  """One line for an exception raised while reading --config / --config.* flags."""
  for arg in argv[1:]:
    name = arg.split("=", 1)[0][len("--config."):] if arg.startswith("--config.") else ""
    if name in MOVED:
      return (f"error: bad --config flag {arg}: config field `{name}` moved to "
              f"`{MOVED[name]}` (use --config.{MOVED[name]}=...)")
  inner = error.args[0] if error.args else error
  while isinstance(inner, BaseException) and inner.args:  # KeyError inside AttributeError
    inner = inner.args[0]
  msg = str(inner)
  for _ in range(2):  # repr()-quoted text, possibly twice
    msg = msg.replace("\\n", "\n").replace("\\'", "'").strip()
    if len(msg) > 1 and msg[0] == msg[-1] == "'":
      msg = msg[1:-1]
  key = msg.split("'")[1] if msg.count("'") >= 2 else msg.split()[0] if msg else ""
  msg = "; ".join(line.strip() for line in msg.splitlines() if line.strip())
  if msg.startswith(f"'{key}';"):  # ml_collections' unknown field: the name, then a hint
    msg = f"no config field {key!r}." + msg[len(key) + 3:]
  bad = [a for a in argv[1:] if a.startswith("--config") and key and f".{key}" in a]
  where = f" {bad[0]}" if bad else ""
  kind = "" if isinstance(error, flags.Error) else f"{type(error).__name__}: "
  return f"error: bad --config flag{where}: {kind}{msg}"


def define_config_flag(default: str, help_text: str = "Run config file."):
  """DEFINE_config_file("config", default); a bad default-file override exits with one line."""
  try:
    return config_flags.DEFINE_config_file("config", default, help_text)
  except Exception as e:  # pylint: disable=broad-except  (raised while reading sys.argv)
    sys.exit(config_flag_error(e, sys.argv))


def parse_flags(argv: list[str]) -> list[str]:
  """`app.run(main, flags_parser=parse_flags)`: absl's parsing, one line on any flag error."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, flags.Error) and "config" not in str(e):  # another flag's error
      sys.exit(f"error: {' '.join(str(e).split())} (see --help)")
    sys.exit(config_flag_error(e, argv))
