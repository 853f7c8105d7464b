#!/usr/bin/env bash
# Weight-only quantization on the GPU, one device call (< 8 min on an H100):
#   1. GPU tests: the W4A16/W8A16 kernels against their references (bf16, 8B shapes) and
#      quantized tiny checkpoints (GPTQ/AWQ) against their dequantized float copies;
#   2. the kernels against bf16 F.linear on the Llama-3-8B linear shapes, batch 1..64;
#   3. decode tok/s of the Llama-3-8B shape (dummy weights, RTN at load): bf16, int8, int4-g128 at
#      batch 1 (128 in / 256 out), and bf16 vs int4-g128 at batch 16 and 64 (128 in / 128 out),
#      each beside the bytes a decode step reads and the bound they give at 3.0 TB/s.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/quant.sh
#        OUT=dir bash benchmarks/quant.sh sweep  the W4A16/W8A16 tile sweep (< 4 min): bf16, the kernels
#        before s9-w4 and the new ones' candidate tiles on the 8B shapes and LM head at batch 1/4/16/64; writes
#        the best tiles into rooflm/kernels/tuned/weight_only.json for this GPU (commit it).
#        OUT=dir bash benchmarks/quant.sh fp8   FP8 W8A8 instead (< 8 min): its GPU tests, the fp8
#        linear against bf16 on the 8B shapes (benchmarks/fp8_linear.py), the products' accumulation
#        modes at decode and prefill M (benchmarks/fp8_matmul.py), and decode tok/s of the
#        8B shape in bf16 and fp8 at batch 1 (128 in / 256 out) and 64 (128 in / 128 out).
#        OUT=dir bash benchmarks/quant.sh offline   the offline target (< 8 min on an H100):
#        1000 x 1024/1024 with FP8 W8A8 + FP8 KV (static, then per-token scales) beside bf16, each
#        with its printed bound and --breakdown (PROMPTS=n for fewer requests).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/quant-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${1:-}" = offline ]; then
  LONG="--model llama-3-8b --load-format dummy --num-prompts ${PROMPTS:-1000} --input-len 1024 --output-len 1024 --max-model-len 2048"
  # fp8s: static K/V scales (1.0 on dummy weights), as TensorRT-LLM's FP8 KV cache keeps them.
  for v in "fp8s --quantization fp8 --kv-cache-dtype fp8 --kv-cache-scales static" "fp8 --quantization fp8 --kv-cache-dtype fp8" "bf16"; do
    set -- $v; name=$1; shift
    timeout 280 python -m rooflm bench throughput $LONG "$@" --breakdown --disable-tqdm \
      --output-json "$OUT/offline-$name.json" > "$OUT/offline-$name.txt" 2>&1
    echo "$name: $(grep -E 'Output token thr|Measured|Bound' "$OUT/offline-$name.txt" | tr -s ' ' | tr '\n' ';')"
  done
  exit 0
fi
if [ "${1:-}" = sweep ]; then
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
  timeout 230 python benchmarks/quant_gemv_sweep.py --out "$OUT" --table --budget-s 190 \
    --shapes qkv,o,gate_up,down,lm_head 2>&1 | tee "$OUT/gemv-sweep.txt"
  cp rooflm/kernels/tuned/weight_only.json "$OUT/"
  exit 0
fi
if [ "${1:-}" = fp8 ]; then
  timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_w8a8.py \
    tests/kernels/test_norm_act_fp8.py > "$OUT/gpu-tests-fp8.txt" 2>&1
  tail -3 "$OUT/gpu-tests-fp8.txt"
  timeout 120 python benchmarks/fp8_linear.py --out "$OUT" 2>&1 | tee "$OUT/fp8-linear.txt"
  timeout 120 python benchmarks/fp8_matmul.py --out "$OUT" 2>&1 | tee "$OUT/fp8-matmul.txt"
  timeout 200 python benchmarks/quant_decode.py --formats bf16,fp8 --batches 1,64 --out "$OUT/fp8" \
    > "$OUT/decode-fp8.txt" 2>&1 || tail -5 "$OUT/decode-fp8.txt"
  grep -h '^|' "$OUT/decode-fp8.txt"
  exit 0
fi
timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_weight_only.py tests/models/test_gpu_quant.py \
  > "$OUT/gpu-tests.txt" 2>&1; tail -3 "$OUT/gpu-tests.txt"
timeout 120 python benchmarks/quant_kernels.py --out "$OUT" 2>&1 | tee "$OUT/kernels.txt"
timeout 150 python benchmarks/quant_decode.py --formats bf16,int8,int4-g128 --batches 1 --out "$OUT/b1" \
  > "$OUT/decode-b1.txt" 2>&1 || tail -5 "$OUT/decode-b1.txt"; grep '^\[' "$OUT/decode-b1.txt"
timeout 150 python benchmarks/quant_decode.py --formats bf16,int4-g128 --batches 16,64 --out "$OUT/batched" \
  > "$OUT/decode-batched.txt" 2>&1 || tail -5 "$OUT/decode-batched.txt"; grep '^\[' "$OUT/decode-batched.txt"
echo; echo "== decode, Llama-3-8B shape (dummy weights), H100: tok/s beside the byte bound at 3.0 TB/s =="
grep -h '^|' "$OUT/decode-b1.txt" | head -2; grep -h '^| [a-z]' "$OUT/decode-b1.txt" "$OUT/decode-batched.txt" | grep -v '^| format'
tail -1 "$OUT/gpu-tests.txt"
