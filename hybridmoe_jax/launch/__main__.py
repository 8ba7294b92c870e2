"""python -m hybridmoe_jax.launch --target=xpk|jobset|slurm --topology=v5p-64 [...] -- <run_train.py flags>

Prints the recipe (recipes.py) to stdout, or writes it to --output; bad arguments give one
`error:` line and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.launch import recipes


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  run_flags = argv[argv.index("--") + 1:] if "--" in argv else []
  own = argv[:argv.index("--")] if "--" in argv else argv
  p = argparse.ArgumentParser(prog="python -m hybridmoe_jax.launch",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--target", required=True, choices=recipes.TARGETS)
  p.add_argument("--topology", required=True,
                 help="TPU slice (v5p-64, v6e-16) or GPUs <gpu>:<hosts>x<per host> (h100:2x8)")
  p.add_argument("--name", default="hybridmoe-train", help="workload / job name")
  p.add_argument("--docker_image", default="", help="container image holding this repository")
  p.add_argument("--cluster", default="", help="GKE cluster (xpk)")
  p.add_argument("--project", default="")
  p.add_argument("--zone", default="")
  p.add_argument("--num_slices", type=int, default=1, help="TPU slices (xpk multislice)")
  p.add_argument("--time", default="24:00:00", help="SLURM wall time")
  p.add_argument("--partition", default="", help="SLURM partition")
  p.add_argument("--output", default="", help="write here instead of stdout")
  args = p.parse_args(own)
  if not run_flags:
    print("error: no run_train.py flags: put them after `--` (e.g. -- --config=configs/"
          "tiny.py --workdir=gs://bucket/run)", file=sys.stderr)
    return 1
  launch = recipes.Launch(target=args.target, topology=args.topology, name=args.name,
                          image=args.docker_image, run_flags=tuple(run_flags), cluster=args.cluster,
                          project=args.project, zone=args.zone, num_slices=args.num_slices,
                          time=args.time, partition=args.partition)
  try:
    text = recipes.render(launch)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  if args.output:
    with open(args.output, "w", encoding="utf-8") as f:
      f.write(text)
  else:
    sys.stdout.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
