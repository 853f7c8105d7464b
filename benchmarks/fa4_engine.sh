#!/usr/bin/env bash
# FlashAttention-4 prefill on the H100 (one device call each part, after the wheels are
# carried: benchmarks/fa4_setup.sh). kernels: GPU tests of the FA4 path, then the kernel table
# (benchmarks/fa4_prefill.py). engine: Triton prefill at block 64 (the default without FA4) against
# FA4 at VARIANTS (prefill:block), side by side: TTFT/TPOT at 1k and 16k prompts (Llama-3.1-8B
# shape, batch 1) and the 1000-request ShareGPT-like offline workload (Llama-3-8B shape), dummy bf16.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/fa4_engine.sh kernels|engine
set -uo pipefail
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/fa4_setup.sh" > /dev/null
OUT=${OUT:-benchmarks/results/fa4-prefill}
PART=${1:-engine}
VARIANTS=${VARIANTS:-"triton:64 fa4:128"}
mkdir -p "$OUT"
{ date -Is; echo "commit ${ROOFLM_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } > "$OUT/env.txt"
if [ "$PART" = kernels ]; then
  python3 -m pytest -q tests/kernels/test_fa4_prefill.py tests/kernels/test_backend.py 2>&1 | tail -5 | tee "$OUT/gpu-tests.txt"
  python3 benchmarks/fa4_prefill.py --out "$OUT" 2>&1 | grep -v -i "warn\|^  " > "$OUT/kernels.txt"
  cat "$OUT/kernels.txt"
fi
if [ "$PART" = engine ]; then
  for v in $VARIANTS; do
    pa=${v%%:*}; bs=${v##*:}; tag="$pa-bs$bs"
    python3 -m rooflm bench latency --model llama-3.1-8b --load-format dummy --max-model-len 32768 \
      --batch-size 1 --input-len 1024 16000 --output-len 32 --num-iters 3 --num-iters-warmup 1 --block-size $bs \
      --prefill-attention $pa --disable-tqdm --output-json "$OUT/long-$tag.json" > "$OUT/long-$tag.txt" 2>&1
    python3 -m rooflm bench throughput --model llama-3-8b --load-format dummy --num-prompts 1000 --input-len 230 \
      --output-len 200 --range-ratio 0.9 --max-model-len 4096 --block-size $bs --prefill-attention $pa --disable-tqdm \
      --output-json "$OUT/sharegpt-$tag.json" > "$OUT/sharegpt-$tag.txt" 2>&1
    echo "== $tag"; grep -i "ttft\|tpot\|input" "$OUT/long-$tag.txt" | tail -6
    grep -i "tok/s\|bound" "$OUT/sharegpt-$tag.txt" | tail -3
  done
fi
