#!/usr/bin/env bash
# One device call: offline throughput on ShareGPT-like traffic (1000 requests, ~230 in /
# ~200 out, lengths uniform +-90%) and 1000 x 1024/1024, with the step breakdown; ShareGPT-like with
# the defaults and with the earlier default (512 sequences) side by side, and with a static-scale
# FP8 cache; then the latency rows that must not regress (batch 1, and 64 x 1024/256) at both caps.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/traffic.sh [quick|diag|trace]
# trace: device traces (time by kernel class) of a window of mixed steps and one of decode steps.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/traffic}
mkdir -p "$OUT"
MODEL="--model llama-3-8b --load-format dummy"
SHAREGPT="--num-prompts 1000 --input-len 230 --output-len 200 --range-ratio 0.9 --max-model-len 4096"
LONG="--num-prompts 1000 --input-len 1024 --output-len 1024 --max-model-len 2048"
BEFORE="--max-num-seqs 512"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
run() {  # name, flags...
  local name=$1; shift
  python -m rooflm bench throughput $MODEL "$@" --breakdown --disable-tqdm \
    --output-json "$OUT/$name.json" 2>&1 | grep -v "^result written" | tail -24 | tee "$OUT/$name.txt"
}
if [ "${1:-}" = "trace" ]; then
  for window in "mixed 60 6" "decode 300 10"; do
    set -- $window
    python benchmarks/host_profile.py $MODEL $SHAREGPT --device-trace-steps "$3" --skip-steps "$2" --out "$OUT" \
      2>&1 | tail -22 | tee "$OUT/trace-$1.txt"
  done
  exit 0
fi
run sharegpt $SHAREGPT
[ "${1:-}" = "quick" ] && exit 0
if [ "${1:-}" = "diag" ]; then  # why: the same run without async scheduling, and the host under cProfile
  run sharegpt-sync $SHAREGPT --no-async-scheduling
  python benchmarks/host_profile.py $MODEL --num-prompts 500 --input-len 230 --output-len 200 \
    --range-ratio 0.9 --max-model-len 4096 --out "$OUT" --top 40 2>&1 | head -70
  exit 0
fi
run sharegpt-512seqs $SHAREGPT $BEFORE
run sharegpt-fp8-static $SHAREGPT --kv-cache-dtype fp8 --kv-cache-scales static
latency() {  # name, flags...
  local name=$1; shift
  python -m rooflm bench latency $MODEL "$@" --num-iters-warmup 1 --max-model-len 2048 --disable-tqdm \
    --output-json "$OUT/$name.json" 2>&1 | grep -v "^result written" | tail -8 | tee "$OUT/$name.txt"
}
latency latency-b1 --batch-size 1 --input-len 128 --output-len 256 --num-iters 3
latency latency-b1-512seqs --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 $BEFORE
latency latency-b64 --batch-size 64 --input-len 1024 --output-len 256 --num-iters 2
latency latency-b64-512seqs --batch-size 64 --input-len 1024 --output-len 256 --num-iters 2 $BEFORE
run 1024x1024 $LONG
