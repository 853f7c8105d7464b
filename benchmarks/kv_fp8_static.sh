#!/usr/bin/env bash
# Static FP8 K/V scales (one per layer and KV head) against per-token ones, one device call
# (< 9 min on an H100):
#   1. the FP8 KV tests on the GPU: every kernel test of tests/kernels/test_fp8_kv.py compiled, and
#      the engine on a tiny model against the CPU reference with each scale format;
#   2. benchmarks/kv_fp8.py at the engine's block size (64): bf16, per-token FP8 and static FP8
#      decode/prefill, and the static kernel's tile sweep (with register-capped candidates);
#   3. the offline row, 1000 x 1024/1024 with FP8 W8A8 + FP8 KV, per-token then static
#      scales (PROMPTS=n for fewer requests), each with its printed bound and --breakdown.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/kv_fp8_static.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/kv-fp8-static}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kv.py \
  "tests/unit/test_fp8_kv_engine.py::test_gpu_fp8_cache_matches_the_cpu_reference" \
  > "$OUT/gpu-tests.txt" 2>&1; tail -1 "$OUT/gpu-tests.txt"
timeout 150 python benchmarks/kv_fp8.py --block-size 64 --out "$OUT" 2>&1 | tee "$OUT/kernels-bs64.txt"
LONG="--model llama-3-8b --load-format dummy --num-prompts ${PROMPTS:-1000} --input-len 1024 --output-len 1024 --max-model-len 2048"
for scales in per-token static; do
  timeout 200 python -m rooflm bench throughput $LONG --quantization fp8 --kv-cache-dtype fp8 \
    --kv-cache-scales $scales --breakdown --disable-tqdm --output-json "$OUT/offline-$scales.json" \
    > "$OUT/offline-$scales.txt" 2>&1
  echo "$scales: $(grep -E 'Output token thr|Measured|Bound|KV cache' "$OUT/offline-$scales.txt" | tr -s ' ' | tr '\n' ';')"
done
