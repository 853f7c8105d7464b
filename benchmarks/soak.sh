#!/usr/bin/env bash
# One device call: benchmarks/soak.py against a `rooflm serve` of the Llama-3-8B shape
# (dummy weights, the real Llama-3 tokenizer shape via benchmarks/models/llama-3-8b-dummy).
# Usage (GPU machine, repo root): OUT=dir MINUTES=10 RATE=8 bash benchmarks/soak.sh
# Carry .whl/ (benchmarks/fetch_serving_wheels.sh): the GPU machine has no server stack.
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/soak}
MODEL_DIR=${MODEL_DIR:-benchmarks/models/llama-3-8b-dummy}
mkdir -p "$OUT"
[ -f "$MODEL_DIR/config.json" ] || python3 benchmarks/make_dummy_model_dir.py --preset llama-3-8b --out "$MODEL_DIR"
python3 benchmarks/soak.py --out "$OUT" --minutes "${MINUTES:-10}" --rate "${RATE:-8}" \
  --serve-args "--model $MODEL_DIR --load-format dummy --max-model-len 4096 --max-queued-requests 256"
