#!/usr/bin/env bash
# One device call: GPU tests, then the engine benchmarks on a Llama-3-8B-shape model
# with dummy weights. Usage (on the GPU machine, repo root): OUT=dir bash benchmarks/gpu_suite.sh [quick]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/gpu-suite}
mkdir -p "$OUT"
MODEL="--model llama-3-8b --load-format dummy"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"

python -m pytest -q tests/models/test_gpu_e2e.py tests/unit/test_sampler.py tests/kernels/test_gemv.py \
  tests/kernels/test_engine_triton.py tests/kernels/test_deterministic.py tests/models/test_gpu_deterministic.py \
  tests/models/test_gpu_spec.py tests/kernels/test_ngram_propose.py tests/kernels/test_spec_loop_step.py \
  tests/kernels/test_small_m_linear.py -p no:cacheprovider 2>&1 \
  | tail -15 | tee "$OUT/pytest-gpu.txt"

# Batch-1 decode: 128-token prompt, 256 new tokens (the gpt-fast comparison).
python -m rooflm --log-level INFO bench latency $MODEL --batch-size 1 --input-len 128 --output-len 256 \
  --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 \
  --output-json "$OUT/latency-b1.json" --output-md "$OUT/latency-b1.md" --disable-tqdm 2>&1 | tail -25

# Batched decode: 64 sequences, 1024-token prompts, 256 new tokens.
python -m rooflm --log-level INFO bench latency $MODEL --batch-size 64 --input-len 1024 --output-len 256 \
  --num-iters 2 --num-iters-warmup 1 --max-model-len 2048 \
  --output-json "$OUT/latency-b64.json" --output-md "$OUT/latency-b64.md" --disable-tqdm 2>&1 | tail -25

# A decode step's host / graph / kernel split, fused GEMV layers and PDL on and off (batch 1 and 64).
python benchmarks/decode_step.py --batch-sizes 1 64 --variants gemv+pdl gemv cublas --out "$OUT" 2>&1 \
  | grep -v Warn | tail -5

# Where a step's time goes at batch 1 and 64 (GPU busy fraction, kernel classes, verdict).
for B in 1 64; do
  python -m rooflm profile --model llama-3-8b --load-format dummy --batch-size $B --input-len 1024 \
    --output-len 200 --steps 20 --max-model-len 2048 --output "$OUT/profile-b$B" 2>&1 \
    | grep -v "^  top ops" | tee "$OUT/profile-b$B.txt" | tail -40
  rm -f "$OUT/profile-b$B/trace.json"  # tens of MB; rerun to get it
done

if [ "${1:-}" != "quick" ]; then
  # Offline throughput: 1000 prompts of 1024 random tokens, 1024 output tokens each.
  python -m rooflm --log-level INFO bench throughput $MODEL --num-prompts 1000 --input-len 1024 --output-len 1024 \
    --max-model-len 2048 --output-json "$OUT/throughput.json" --disable-tqdm 2>&1 | tail -25
fi
