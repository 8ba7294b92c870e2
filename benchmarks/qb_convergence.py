"""MaxVio per bias update on one fixed, skewed batch: Quantile Balancing vs the sign rule.

DESIGN s4.2. The batch is m tokens of scores s = sigmoid(z + skew * o_j), z ~ N(0, 1) per
token and expert, o_j ~ N(0, 1) per expert (a router that prefers some experts for every
token). Each update routes the batch with the current bias, records MaxVio, then updates the
bias from the same batch: QB exact (sort/top_k per expert), QB histogram (the scalable form),
and DeepSeek's sign rule b_j -= gamma sign(load_j - mean). The K3 spec (E=896, k=16, m=4096,
skew 0.32, MaxVio ~7 at bias 0) is the one tests/ops/test_quantile_balance.py asserts on.

  python benchmarks/qb_convergence.py [--spec k3|kimi_linear_48b] [--updates 10]
                                      [--sign_updates 400] [--gamma 1e-3]
Prints a table, then one JSON line per method.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from hybridmoe_jax.ops.quantile_balance import quantile_balance, sign_rule_update
from hybridmoe_jax.ops.routing import expert_load, max_violation, sigmoid_topk_route
from benchmarks._timing import stopwatch

# name: (E experts, k per token, m tokens, skew of the per-expert logit offsets)
SPECS = {
    "k3": (896, 16, 4096, 0.32),
    "kimi_linear_48b": (256, 8, 4096, 0.33),
}


def skewed_logits(num_experts: int, m: int, skew: float, seed: int = 0) -> jax.Array:
  """[m, E] fp32 router logits with a per-expert offset (the test's batch for seed 0)."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(k1, (m, num_experts))
          + skew * jax.random.normal(k2, (num_experts,)))


def curve(logits: jax.Array, k: int, update, steps: int) -> tuple[list[float], float]:
  """MaxVio before each of `steps` updates and after the last; seconds per update."""
  num_experts = logits.shape[1]

  def step(bias, _):
    load = expert_load(sigmoid_topk_route(logits, bias, k).experts, num_experts)
    return update(bias, load), max_violation(load)

  run = jax.jit(lambda: jax.lax.scan(step, jnp.zeros(num_experts), None, length=steps))
  jax.block_until_ready(run())  # compile
  with stopwatch() as sw:
    bias, vios = jax.block_until_ready(run())
  seconds = sw.seconds / steps
  final = expert_load(sigmoid_topk_route(logits, bias, k).experts, num_experts)
  return [float(v) for v in vios] + [float(max_violation(final))], seconds


def first_below(values: list[float], threshold: float) -> int | None:
  return next((i for i, v in enumerate(values) if v < threshold), None)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--spec", choices=sorted(SPECS), default="k3")
  parser.add_argument("--updates", type=int, default=10)
  parser.add_argument("--sign_updates", type=int, default=400)
  parser.add_argument("--gamma", type=float, default=1e-3)
  parser.add_argument("--num_bins", type=int, default=1000)
  args = parser.parse_args()

  num_experts, k, m, skew = SPECS[args.spec]
  logits = skewed_logits(num_experts, m, skew)
  scores = jax.nn.sigmoid(logits)
  methods = {
      "qb_exact": (lambda b, _: quantile_balance(scores, b, k), args.updates),
      "qb_histogram": (lambda b, _: quantile_balance(scores, b, k, method="histogram",
                                                     num_bins=args.num_bins), args.updates),
      f"sign_gamma{args.gamma:g}": (lambda b, load: sign_rule_update(load, b, args.gamma),
                                    args.sign_updates),
  }
  results = {name: curve(logits, k, fn, steps) for name, (fn, steps) in methods.items()}

  print(f"spec={args.spec} E={num_experts} k={k} m={m} skew={skew} "
        f"target={m * k / num_experts:.2f} tokens/expert")
  rows = sorted({i for i in range(args.updates + 1)}
                | {i for i in (20, 50, 100, 200, 300, 400, 500, 1000) if i <= args.sign_updates})
  print("update  " + "  ".join(f"{name:>16}" for name in results))
  for i in rows:
    cells = [f"{vals[i]:16.3f}" if i < len(vals) else " " * 16 for vals, _ in results.values()]
    print(f"{i:6d}  " + "  ".join(cells))
  for name, (vals, seconds) in results.items():
    tail = vals[-max(1, len(vals) // 4):]
    print(json.dumps({"spec": args.spec, "method": name, "max_vio": [round(v, 4) for v in vals],
                      "first_update_below_0.1": first_below(vals, 0.1),
                      "min_max_vio": round(min(vals), 4),
                      # steady state: mean over the last quarter of the updates
                      "tail_mean_max_vio": round(sum(tail) / len(tail), 4),
                      "ms_per_update": round(1e3 * seconds, 2)}))


if __name__ == "__main__":
  main()
