#!/usr/bin/env bash
# One command: benchmarks/soak.py's mixed traffic (streaming and not, n=2, structured outputs,
# tools, long prompts, client disconnects, 20% hostile requests from the corpus), sampling host
# RSS, device memory, open fds, KV blocks in use and Triton cache entries every 10 s, ending with
# a verdict line (exit 0 when it passes).
#
# GPU (the lead's run; repo root, one device call): a `rooflm serve` of the Llama-3-8B shape
# (dummy weights) for 10 minutes. RATE should be ~70% of what the server sustains: 8 req/s with
# max_tokens <= 128 kept an H100 well below saturation; raise it on an H200.
#   OUT=dir MINUTES=10 RATE=8 bash benchmarks/soak.sh
# Carry .whl/ (benchmarks/fetch_serving_wheels.sh): the GPU machine has no server stack.
#
# CPU (a 30-second smoke run of the whole harness, the default model):
#   CPU=1 OUT=/tmp/soak-cpu bash benchmarks/soak.sh
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/soak}
mkdir -p "$OUT"
if [ "${CPU:-0}" = 1 ]; then
  # A rate a busy 2-core machine sustains (2 req/s there timed 21 requests out).
  exec "$PYTHON" benchmarks/soak.py --out "$OUT" --minutes "${MINUTES:-0.5}" --rate "${RATE:-0.5}" \
    --max-tokens 12 --prompt-words 40 --long-prompt-words 150 --warmup-s 0 --request-timeout 600 \
    --serve-args "--device cpu --max-model-len 1024 --max-queued-requests 64"
fi
MODEL_DIR=${MODEL_DIR:-benchmarks/models/llama-3-8b-dummy}
[ -f "$MODEL_DIR/config.json" ] || "$PYTHON" benchmarks/make_dummy_model_dir.py --preset llama-3-8b --out "$MODEL_DIR"
exec "$PYTHON" benchmarks/soak.py --out "$OUT" --minutes "${MINUTES:-10}" --rate "${RATE:-8}" \
  --serve-args "--model $MODEL_DIR --load-format dummy --max-model-len 4096 --max-queued-requests 256"
