#!/usr/bin/env bash
# One device call (H100, ~8 minutes): the attention kernels' experiments
# (benchmarks/attention_hopper.py), then the engine at KV block sizes 16 and 64 side by side:
# TTFT/TPOT at 1k and 16k prompts (Llama-3.1-8B shape, batch 1) and the 1000-request ShareGPT-like
# offline workload (Llama-3-8B shape), all dummy bf16 weights.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/attention_hopper.sh [kernels|engine|all]
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/attention-hopper}
PART=${1:-all}
BLOCK_SIZES=${BLOCK_SIZES:-"16 64"}
mkdir -p "$OUT"
{ date -Is; echo "commit ${ROOFLM_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > "$OUT/env.txt"
if [ "$PART" != engine ]; then
  python3 benchmarks/attention_hopper.py --out "$OUT" 2>&1 | grep -v -i warn > "$OUT/kernels.txt"
  sed -n '/^part /,$p' "$OUT/kernels.txt"
fi
if [ "$PART" != kernels ]; then
  for bs in $BLOCK_SIZES; do
    python3 -m rooflm bench latency --model llama-3.1-8b --load-format dummy --max-model-len 32768 \
      --batch-size 1 --input-len 1024 16000 --output-len 32 --num-iters 3 --num-iters-warmup 1 --block-size $bs \
      --disable-tqdm --output-json "$OUT/long-bs$bs.json" > "$OUT/long-bs$bs.txt" 2>&1
    python3 -m rooflm bench throughput --model llama-3-8b --load-format dummy --num-prompts 1000 --input-len 230 \
      --output-len 200 --range-ratio 0.9 --max-model-len 4096 --block-size $bs --disable-tqdm \
      --output-json "$OUT/sharegpt-bs$bs.json" > "$OUT/sharegpt-bs$bs.txt" 2>&1
    echo "== block size $bs"; grep -i "ttft\|tpot\|input" "$OUT/long-bs$bs.txt" | tail -6
    grep -i "tok/s\|bound" "$OUT/sharegpt-bs$bs.txt" | tail -3
  done
fi
