"""CLI: python -m hybridmoe_jax.convert --from_hf HF_DIR --to OUT
        python -m hybridmoe_jax.convert --to_hf OUT --from SRC [--dtype bfloat16]

--from_hf writes our params export (loadable by `run_eval.py --params=OUT` and
`hybridmoe_jax.loading.load`); --to_hf writes a Kimi-Linear HF dir from
one of our params exports or a training workdir. Prints a JSON summary and the peak host
memory of this process (`peak_rss_bytes`) on stdout; errors are one line on stderr with
exit status 2.
"""

import argparse
import json
import resource
import sys

from hybridmoe_jax.config import ConfigError
from hybridmoe_jax.convert import convert
from hybridmoe_jax.convert.hf_weights import TensorMismatch
from hybridmoe_jax.io.safetensors import SafetensorsError
from hybridmoe_jax.cli import io_noise


def peak_rss_bytes() -> int:
  """This process's peak resident memory: VmHWM on Linux (reset by exec, unlike ru_maxrss,
  which keeps the high-water mark of the process image before exec), else ru_maxrss."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  scale = 1 if sys.platform == "darwin" else 1024    # bytes on macOS, KiB on Linux
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m hybridmoe_jax.convert", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--from_hf", metavar="HF_DIR", help="a Kimi-Linear Hugging Face directory")
  p.add_argument("--to", metavar="OUT", help="with --from_hf: the params export to write")
  p.add_argument("--to_hf", metavar="OUT", help="the Hugging Face directory to write")
  p.add_argument("--from", dest="src", metavar="SRC",
                 help="with --to_hf: one of our params exports or a training workdir")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                 help="with --to_hf: cast the weights (default: keep the stored dtypes)")
  args = p.parse_args(argv)
  if bool(args.from_hf) == bool(args.to_hf):
    p.error("give exactly one of --from_hf HF_DIR (with --to OUT) or --to_hf OUT (with "
            "--from SRC)")
  if args.from_hf and (not args.to or args.src or args.dtype):
    p.error("--from_hf needs --to OUT (and takes neither --from nor --dtype)")
  if args.to_hf and (not args.src or args.to):
    p.error("--to_hf needs --from SRC (and does not take --to)")
  try:
    if args.from_hf:
      summary = convert.from_hf(args.from_hf, args.to)
    else:
      summary = convert.to_hf(args.src, args.to_hf, dtype=args.dtype)
  except (ConfigError, TensorMismatch, SafetensorsError, FileExistsError,
          FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # a full disk, quota, file-size limit or permission while writing
    out = args.to or args.to_hf
    what, fix = io_noise.describe_write_error(e)
    print(f"error: cannot write {e.filename or out}: {what}; nothing was left at {out} "
          f"(its .partial was removed). {fix[0].upper() + fix[1:]}, then rerun",
          file=sys.stderr)
    return 2
  summary["peak_rss_bytes"] = peak_rss_bytes()
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
