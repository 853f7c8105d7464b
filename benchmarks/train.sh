#!/usr/bin/env bash
# One device call (one H100, < 8 minutes): `rooflm train` on the Llama-3.2-1B shape (dummy weights),
# bf16, seq 2048: the knob table of `rooflm bench train` (its compile row is the best flags) beside an
# eager HF-transformers step of the same config. Prints a short table last.
#   OUT=dir bash benchmarks/train.sh     KNOBS=... picks rows (each compiled row costs ~30-60 s of
#   compilation), HF_COMPILE=1 adds compiled HF, TESTS=1 runs `pytest -m gpu tests/train` first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/train-h100}
mkdir -p "$OUT"
SHAPE="--model llama-3.2-1b --load-format dummy --seq-len 2048"
MB=${MICRO_BATCH:-4}
GA=${GRAD_ACCUM:-2}
KNOBS=${KNOBS:-fp32,bf16,fused,compile,cudnn,selective,full,fsdp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"

if [[ "${TESTS:-0}" == 1 ]]; then
  python -m pytest -q -m gpu tests/train -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest-gpu.txt"
fi

# 1. HF transformers, eager (and compiled with HF_COMPILE=1), the same shape and step.
python benchmarks/train_hf.py --seq-len 2048 --micro-batch "$MB" --grad-accum "$GA" --steps 8 \
  --out "$OUT/hf_eager.json" 2>&1 | grep -v Warn | tail -3
if [[ "${HF_COMPILE:-0}" == 1 ]]; then
  python benchmarks/train_hf.py --seq-len 2048 --micro-batch "$MB" --grad-accum "$GA" --steps 8 --compile \
    --out "$OUT/hf_compile.json" 2>&1 | grep -v Warn | tail -3
fi

# 2. The knob table: one shape, one knob at a time; its "compile" row (bf16 autocast, torch.compile
#    per block, fused AdamW) is rooflm's best, written in full to $OUT/train_compile.json.
python -m rooflm bench train $SHAPE --micro-batch "$MB" --grad-accum "$GA" --max-steps 6 \
  --warmup-measure-steps 2 --knobs "$KNOBS" --out "$OUT" 2>&1 | grep -v Warn | tail -12

# 3. The short table: rooflm vs HF, memory vs prediction, then the knob table.
python benchmarks/train_report.py "$OUT" | tee "$OUT/summary.md"
