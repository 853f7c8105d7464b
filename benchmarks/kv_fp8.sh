#!/usr/bin/env bash
# FP8 KV cache (--kv-cache-dtype fp8) against the bf16 cache, one device call: the GPU tests of
# the attention kernels (compiled), the kernels side by side, then the engine on ShareGPT-like
# traffic, 500 x 1024/1024 and batch-1 latency with each cache.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/kv_fp8.sh [quick]   (quick: fewer tests, no latency)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/kv-fp8}
mkdir -p "$OUT"
MODEL="--model llama-3-8b --load-format dummy"
SHAREGPT="--num-prompts 1000 --input-len 230 --output-len 200 --range-ratio 0.9 --max-model-len 4096"
LONG="--num-prompts ${LONG_PROMPTS:-500} --input-len 1024 --output-len 1024 --max-model-len 2048"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
# quick: the FP8 tests and the backend's only (the full kernel suite: tests/kernels, 2 min more).
TESTS="tests/kernels/test_fp8_kv.py tests/kernels/test_backend.py"
[ "${1:-}" = "quick" ] || TESTS="$TESTS tests/kernels/test_decode_attention.py tests/kernels/test_prefill_attention.py tests/kernels/test_rope_kv_write.py"
timeout 240 python -m pytest -q -p no:cacheprovider $TESTS > "$OUT/gpu-tests.txt" 2>&1; tail -2 "$OUT/gpu-tests.txt"
timeout 120 python benchmarks/kv_fp8.py --out "$OUT" 2>&1 | tee "$OUT/kernels.txt"
run() {  # name, flags...
  local name=$1; shift
  timeout 200 python -m rooflm bench throughput $MODEL "$@" --breakdown --disable-tqdm --output-json "$OUT/$name.json" \
    > "$OUT/$name.txt" 2>&1
  echo "$name: $(grep -E 'Output token thr|Measured|Bound|Preemptions' "$OUT/$name.txt" | tr -s ' ' | tr '\n' ';')"
}
run sharegpt-bf16 $SHAREGPT
run sharegpt-fp8 $SHAREGPT --kv-cache-dtype fp8
run long-bf16 $LONG
run long-fp8 $LONG --kv-cache-dtype fp8
[ "${1:-}" = "quick" ] && exit 0
for kv in auto fp8; do
  timeout 100 python -m rooflm bench latency $MODEL --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 \
    --num-iters-warmup 1 --max-model-len 2048 --kv-cache-dtype $kv --disable-tqdm --output-json "$OUT/latency-b1-$kv.json" \
    > "$OUT/latency-b1-$kv.txt" 2>&1
  echo "latency b1 $kv: $(grep -iE 'TPOT|tok/s' "$OUT/latency-b1-$kv.txt" | head -2 | tr -s ' ' | tr '\n' ' ')"
done
