# latency A/B: prefill backend x block size (batch 1, 1k and 16k), after fa4_setup
for v in triton:64 fa4:128 triton:128 fa4:64; do
  pa=${v%%:*}; bs=${v##*:}
  python3 -m rooflm bench latency --model llama-3.1-8b --load-format dummy --max-model-len 32768 \
    --batch-size 1 --input-len 1024 16000 --output-len 32 --num-iters 3 --num-iters-warmup 1 --block-size $bs \
    --prefill-attention $pa --disable-tqdm --output-json "$1/ab-$pa-bs$bs.json" > "$1/ab-$pa-bs$bs.txt" 2>&1
  echo "== $v"; grep -A2 "input    TTFT" "$1/ab-$pa-bs$bs.txt" | tail -2
done
