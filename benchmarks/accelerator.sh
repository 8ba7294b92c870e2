#!/usr/bin/env bash
# One prepared run on an accelerator (written for one H200; works on any GPU/TPU jax sees):
#   1. the jitted train step of the tiny and small presets (ms/step, tokens/s)
#   2. the Pallas KDA kernel (split and fused forward) vs the XLA chunked path and fla's
#      chunk_kda (GPU, when fla is installed), fwd and fwd+bwd, T = 8K and 32K
#   3. decode tokens/s and TTFT vs context (hybrid vs all-MLA)
#   4. MoE cost vs expert count (sparse ragged dispatch vs dense)
# Writes $OUT/*.jsonl (one JSON line per measurement) and $OUT/benchmarks_rows.md (markdown
# rows for BENCHMARKS.md). Each part has its own time limit, so the whole run stays under
# 8 minutes; a part that hits its limit keeps the rows it already printed.
#   bash benchmarks/accelerator.sh          # on the accelerator machine, OUT=<dir>
#   bash benchmarks/accelerator.sh --dry    # CPU: every part on tiny shapes, interpreted
#                                           # kernels (caps of 240 s per part for a busy box)
# Offline: install the project with `pip install --no-deps -e .` (no network, no grain).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/accelerator_out}
mkdir -p "$OUT"
DRY=0
[[ "${1:-}" == "--dry" ]] && DRY=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if (( DRY )); then export JAX_PLATFORMS=cpu; fi
part() {  # part NAME LIMIT_S CMD...: run with a time limit, keep its JSON lines
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/commands.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -h '^JSON \|^{' "$OUT/$name.log" | sed 's/^JSON //' >> "$OUT/$name.jsonl"
  echo "   rc=$rc $((SECONDS - t0))s, $(wc -l < "$OUT/$name.jsonl") rows" | tee -a "$OUT/commands.txt"
}
python -c "import jax; print('devices:', jax.devices())" | tee "$OUT/device.txt"
if (( DRY )); then
  part train 240 python benchmarks/accelerator.py train --presets tiny --batch 1 --seq 64 \
      --steps 1 --dtype float32 --out "$OUT/train_step.jsonl.tmp"
  part kda 240 python benchmarks/kda_kernels.py --small --impls pallas chunked
  part decode 240 python benchmarks/decode.py --contexts 64 --decode_steps 2 --models hybrid \
      --budget_s 1000
  part moe 240 python benchmarks/moe_dispatch.py --experts 4 8 --tokens 64 --repeats 1
else
  part train 150 python benchmarks/accelerator.py train --presets tiny small --batch 8 \
      --seq 2048 --steps 5 --out "$OUT/train_step.jsonl.tmp"
  # P2: our kernel (split forward: the GPU default; fused) vs the XLA path and, where
  # flash-linear-attention is installed (pip install fla-core torch), fla's chunk_kda: the
  # same shapes as benchmarks/kda_gpu_aot.py's compiler reports (BENCHMARKS.md).
  part kda 150 python benchmarks/kda_kernels.py --T 8192 32768 \
      --impls pallas-split pallas chunked fla --repeats 5
  part decode 90 python benchmarks/decode.py --contexts 1024,8192,32768 --decode_steps 32 \
      --budget_s 40
  part moe 60 python benchmarks/moe_dispatch.py --experts 16 64 256 --tokens 16384 --d 1024 \
      --inter 512 --repeats 5
fi
rm -f "$OUT/train_step.jsonl.tmp"
python benchmarks/accelerator.py rows --jsonl "$OUT"/train.jsonl "$OUT"/kda.jsonl \
    "$OUT"/decode.jsonl "$OUT"/moe.jsonl \
    --header "Device: $(tail -1 "$OUT/device.txt"); commands: $OUT/commands.txt" \
    --out "$OUT/benchmarks_rows.md"
