#!/usr/bin/env bash
# The decode kernel's key-tile offsets when a tile fills one whole cache block (block 128,
# BLOCK_N 128): from one block-table entry (254 registers, 2 CTAs an SM, sm_90 compile) or key by
# key (131 registers, 3 CTAs). ROOFLM_DECODE_ONE_ENTRY=1|0, side by side: the kernel, batch-1 TPOT
# (fused GEMV chain) and 64 x 1024/256 TPOT. Usage (GPU machine): bash benchmarks/one_entry_ab.sh DIR
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mkdir -p "$1"
for flag in ${FLAGS:-1 0 1 0}; do
  export ROOFLM_DECODE_ONE_ENTRY=$flag
  [ -f "$1/kernel-$flag.txt" ] || python3 benchmarks/block_size_decode.py 2>&1 | grep -v -i warn > "$1/kernel-$flag.txt"
  python3 -m rooflm bench latency --model llama-3.1-8b --load-format dummy --max-model-len 32768 --batch-size 1 \
    --input-len 1024 --output-len 64 --num-iters 3 --num-iters-warmup 1 --block-size 128 --prefill-attention triton \
    --disable-tqdm > "$1/b1-$flag.txt" 2>&1
  python3 -m rooflm bench latency --model llama-3-8b --load-format dummy --batch-size 64 --input-len 1024 \
    --output-len 256 --num-iters 2 --num-iters-warmup 1 --block-size 128 --prefill-attention triton \
    --disable-tqdm > "$1/b64-$flag.txt" 2>&1
  echo "one entry $flag: batch 1 $(grep -i 'median tpot' "$1/b1-$flag.txt") | batch 64 $(grep -i 'median tpot' "$1/b64-$flag.txt")"
done
cat "$1"/kernel-*.txt
