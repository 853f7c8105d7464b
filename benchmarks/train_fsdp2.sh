#!/usr/bin/env bash
# H200 x2 (one device call, a few minutes): FSDP2 over 2 GPUs against 1, same per-GPU micro-batch,
# Llama-3.2-1B shape, bf16, seq 2048, best flags. Target: 2 GPUs >= 1.85x the tokens/s of one.
#   OUT=dir bash benchmarks/train_fsdp2.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/train-fsdp2}
mkdir -p "$OUT"
ARGS="--model llama-3.2-1b --load-format dummy --seq-len 2048 --micro-batch ${MICRO_BATCH:-4}
  --grad-accum ${GRAD_ACCUM:-2} --precision bf16 --compile --fused --parallel fsdp --max-steps 8
  --warmup-measure-steps 3 --no-progress"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
CUDA_VISIBLE_DEVICES=0 python -m torch.distributed.run --standalone --nproc-per-node 1 -m rooflm train $ARGS \
  --results "$OUT/fsdp1.json" 2>&1 | grep -v Warn | tail -8
python -m torch.distributed.run --standalone --nproc-per-node 2 -m rooflm train $ARGS \
  --results "$OUT/fsdp2.json" 2>&1 | grep -v Warn | tail -8
python - "$OUT" <<'PY'
import json, sys
one, two = (json.load(open(f"{sys.argv[1]}/fsdp{n}.json")) for n in (1, 2))
ratio = two["tokens_per_s"] / one["tokens_per_s"]
print("| GPUs | tokens/s | MFU per GPU | peak GiB per GPU | predicted GiB |\n| ---: | ---: | ---: | ---: | ---: |")
for n, r in ((1, one), (2, two)):
    print(f"| {n} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_memory_bytes'] / 2**30:.1f} | "
          f"{r['predicted_memory_bytes'] / 2**30:.1f} |")
print(f"2 GPUs / 1 GPU: {ratio:.2f}x (target >= 1.85x); 2-GPU kernels: {two.get('kernels_s')}")
print(f"2-GPU verdict: {two.get('verdict')}")
PY
