#!/usr/bin/env bash
# Speculative decoding's device loop in one device call: GPU tests, the verify graphs'
# replay times (host path's uniform graph vs the loop's), batch 1 at 80%/90% replayed acceptance with
# the loop and with the host path, 80% over ten corruption patterns, small-batch decode with the
# batch-1 tiles on every shape vs the deep ones only, and the adaptive policy at batch 1 and 64.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/spec_loop.sh [quick]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/spec-loop}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python -m pytest -q tests/models/test_gpu_spec.py tests/kernels/test_ngram_propose.py \
  tests/kernels/test_spec_loop_step.py tests/kernels/test_small_m_linear.py -p no:cacheprovider 2>&1 \
  | tail -5 | tee "$OUT/gpu-tests.txt"
python benchmarks/spec_step_breakdown.py --batches 1 --kernels --out "$OUT/breakdown" 2>&1 | grep -E "replay|total"
python benchmarks/spec_decode.py --policy budget --batches 1 --acceptances 0.8 0.9 --replay-seeds 3 --repeats 2 \
  --skip-draft --device-loop both --out "$OUT/budget" 2>&1 | grep "^|"
python benchmarks/spec_decode.py --policy budget --batches 1 --acceptances 0.8 --replay-seeds 10 --repeats 2 \
  --skip-draft --out "$OUT/budget-80-seeds" 2>&1 | grep "^|"
[ "${1:-}" = "quick" ] && exit 0
for B in 4 16; do
  for T in deep 1; do
    ROOFLM_SMALL_M_TILES=$T python -m rooflm bench latency --model llama-3-8b --load-format dummy \
      --max-model-len 2048 --batch-size $B --input-len 128 --output-len 128 --num-iters 2 --num-iters-warmup 1 \
      --output-json "$OUT/latency-b$B-tiles-$T.json" 2>&1 | grep "Median TPOT" | sed "s/^/batch $B tiles $T: /"
  done
done
python benchmarks/spec_decode.py --policy adaptive --batches 1 64 --acceptances 0.9 --repeats 2 --skip-draft \
  --out "$OUT/adaptive" 2>&1 | grep "^|"
python benchmarks/spec_decode.py --policy budget --batches 1 --acceptances 0.8 0.9 --repeats 2 \
  --out "$OUT/budget-draft" 2>&1 | grep "^|"
