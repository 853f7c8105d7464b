#!/usr/bin/env bash
# One device call (~3-4 minutes on an H100): TTFT and TPOT against context length on the
# Llama-3.1-8B shape (dummy bf16 weights, 128k context), batch 1, each beside its roofline floor
# (the prefill chunk by chunk at the datasheet's roofs; one decode step's bytes at its bandwidth).
# The targets at 16k: TTFT <= 420 ms, TPOT <= 5.7 ms (571 / 6.17 when it was filed).
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/long_context.sh
set -euo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/long-context}
LENGTHS=${LENGTHS:-"1024 4096 16000 32768 65536 131000"}
mkdir -p "$OUT"
{ date -Is; echo "commit ${ROOFLM_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } | tee "$OUT/env.txt"
python3 -m rooflm bench latency --model llama-3.1-8b --load-format dummy --max-model-len 131072 \
  --batch-size 1 --input-len $LENGTHS --output-len 32 --num-iters 3 --num-iters-warmup 1 \
  --disable-tqdm --output-json "$OUT/long_context.json" --output-md "$OUT/long_context.md" \
  2>&1 | tee "$OUT/long_context.txt" | tail -12
