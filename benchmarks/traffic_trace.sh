#!/usr/bin/env bash
# Issue 13, one device call: where ShareGPT-like time goes now. The step breakdown at the defaults,
# at 1024 sequences, and with a static-scale FP8 cache; then device traces (time by kernel class) of a
# mid-run window of mixed steps and of a drain window of decode steps.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/traffic_trace.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/traffic-trace}
mkdir -p "$OUT"
MODEL="--model llama-3-8b --load-format dummy"
SHAREGPT="--num-prompts 1000 --input-len 230 --output-len 200 --range-ratio 0.9 --max-model-len 4096"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
run() {  # name, flags...
  local name=$1; shift
  python -m rooflm bench throughput $MODEL "$@" --breakdown --disable-tqdm \
    --output-json "$OUT/$name.json" 2>&1 | grep -v "^result written" | tail -24 | tee "$OUT/$name.txt"
}
trace() {  # name, skip, steps, flags...
  local name=$1 skip=$2 steps=$3; shift 3
  python benchmarks/host_profile.py $MODEL --num-prompts 1000 --input-len 230 --output-len 200 \
    --range-ratio 0.9 --max-model-len 4096 --device-trace-steps "$steps" --skip-steps "$skip" \
    --out "$OUT" "$@" 2>&1 | tail -40 | tee "$OUT/$name.txt"
}
run sharegpt $SHAREGPT
run sharegpt-1024seqs $SHAREGPT --max-num-seqs 1024
trace trace-mid 120 8
trace trace-drain 560 10
run sharegpt-fp8s $SHAREGPT --kv-cache-dtype fp8 --kv-cache-scales static
