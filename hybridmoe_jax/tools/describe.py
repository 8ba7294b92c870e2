"""Print a config's parameter breakdown per component, without allocating the model.

  python -m hybridmoe_jax.tools.describe --config=configs/kimi_k3.py
"""

import os

from absl import app

from hybridmoe_jax.config import flags as cli_flags
from hybridmoe_jax.config import ConfigError, ModelConfig, model_config_from_dict
from hybridmoe_jax.model.count import active_breakdown, param_breakdown, vision_breakdown

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The default found from any working directory (a relative one only from the repo's root).
_CONFIG = cli_flags.define_config_flag(os.path.join(_REPO, "configs", "tiny.py"),
                                       "Model config file.")


def _human(n: float) -> str:
  for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= size:
      return f"{n / size:.2f}{unit}"
  return str(int(n))


def breakdown_table(cfg: ModelConfig) -> str:
  """A fixed-width table: component, total params, active params per token, share."""
  counts = param_breakdown(cfg)
  total = sum(counts.values())
  per_token = active_breakdown(cfg, counts)
  active = sum(per_token.values())
  rows = [f"{'component':<16}{'total':>12}{'active':>12}{'share':>8}"]
  for name, n in counts.items():
    rows.append(f"{name:<16}{_human(n):>12}{_human(per_token[name]):>12}"
                f"{100 * n / total:>7.1f}%")
  rows.append(f"{'TOTAL':<16}{_human(total):>12}{_human(active):>12}{100.0:>7.1f}%")
  rows.append(f"exact: total={total:,} active={active:,}")
  return "\n".join(rows)


def vision_table(cfg: ModelConfig) -> str:
  """The vision tower's parameters per part (separate from the text model's table)."""
  counts = vision_breakdown(cfg)
  total = sum(counts.values())
  v = cfg.vision
  rows = [f"vision tower: {v.num_layers} blocks, width {v.width}, patch {v.patch_size}, "
          f"2x2 merge, position table {v.native_grid}x{v.native_grid}",
          f"{'component':<16}{'params':>12}{'share':>8}"]
  for name, n in counts.items():
    rows.append(f"{name:<16}{_human(n):>12}{100 * n / max(total, 1):>7.1f}%")
  rows.append(f"{'VISION TOTAL':<16}{_human(total):>12}{100.0:>7.1f}%")
  rows.append(f"exact: vision={total:,}")
  return "\n".join(rows)


def main(argv):
  del argv
  try:
    cfg = model_config_from_dict(_CONFIG.value.model)
  except (ConfigError, OSError) as e:  # OSError: the --config file could not be loaded
    raise SystemExit(f"error: {' '.join(str(e).split())}") from None
  kinds = "".join("K" if k == "kda" else "M" for k in cfg.layer_kinds)
  print(f"layers ({cfg.num_layers}): {kinds}   K=KDA M=MLA")
  print("text model:")
  print(breakdown_table(cfg))
  if cfg.vision.enabled:
    print(vision_table(cfg))


if __name__ == "__main__":
  app.run(main, flags_parser=cli_flags.parse_flags)
