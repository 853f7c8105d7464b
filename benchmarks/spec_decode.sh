#!/usr/bin/env bash
# One device call (H100, < 8 minutes): speculative decoding's speedup over plain decode
# against acceptance (replay proposer), n-gram and draft model (1B shape), batch 1 and 64, k=4,
# Llama-3-8B shape with dummy weights; then the GPU spec-decode tests.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/spec_decode.sh
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/spec-h100}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m pytest tests/models/test_gpu_spec.py -q -m gpu -x -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests: $(tail -1 "$OUT/gpu_tests.txt")"
python3 benchmarks/spec_decode.py --out "$OUT" ${SPEC_ARGS:-} 2>&1 | tee "$OUT/spec_decode.log" \
  | grep -v '^{' | grep -v -i warn
