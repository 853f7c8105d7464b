#!/usr/bin/env bash
# A 16k prompt's TTFT against the token budget (chunk size), FA4 prefill at block 128,
# Llama-3.1-8B shape, batch 1. Usage (GPU machine, after fa4_setup.sh's wheels): bash benchmarks/fa4_budget.sh DIR
set -uo pipefail
source "$(dirname "$0")/fa4_setup.sh" > /dev/null
mkdir -p "$1"
for budget in ${BUDGETS:-2048 4096 8192 16384}; do
  python3 -m rooflm bench latency --model llama-3.1-8b --load-format dummy --max-model-len 32768 \
    --batch-size 1 --input-len 1024 16000 --output-len 32 --num-iters 3 --num-iters-warmup 1 \
    --max-num-batched-tokens $budget --disable-tqdm --output-json "$1/budget-$budget.json" > "$1/budget-$budget.txt" 2>&1
  echo "== budget $budget"; grep -A2 "input    TTFT" "$1/budget-$budget.txt" | tail -2
done
