#!/usr/bin/env bash
# One device call: the offline engine and `rooflm serve` on the same workload, side by
# side, and the server/offline throughput ratio. Everything goes under $OUT.
# Usage (GPU machine, repo root): OUT=dir MODEL_DIR=dir bash benchmarks/serving.sh
#   MODEL_DIR: an HF directory with config.json and tokenizer files, no weights (default
#   benchmarks/models/llama-3-8b-dummy, made by benchmarks/make_dummy_model_dir.py if missing);
#   served with --load-format dummy, so the 8B shape streams real text and TTFT/TPOT/ITL are per token.
# Carry .whl/ (benchmarks/fetch_serving_wheels.sh): the GPU machine has no server stack.
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/serving}
MODEL_DIR=${MODEL_DIR:-benchmarks/models/llama-3-8b-dummy}
PORT=${PORT:-8123}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
{ date -Is; git rev-parse HEAD 2>/dev/null; python3 --version
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv; } | tee "$OUT/env.txt"
[ -f "$MODEL_DIR/config.json" ] || python3 benchmarks/make_dummy_model_dir.py --preset llama-3-8b --out "$MODEL_DIR"
NAME=$(basename "$MODEL_DIR")
VOCAB=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL_DIR/config.json")
# The 1000-request workload of the issue: ~230-token prompts, ~200 output tokens, +-90%.
# WORKLOAD, RATES and C1_PROMPTS may be overridden for a quick CPU smoke run of the script itself.
WORKLOAD=${WORKLOAD:-"--num-prompts 1000 --input-len 230 --output-len 200 --range-ratio 0.9"}
RATES=${RATES:-"16 32 48"}
C1_PROMPTS=${C1_PROMPTS:-8}

# (a) The offline engine (in-process, no HTTP): the ceiling the server is measured against.
python3 -m rooflm --log-level INFO bench throughput --model "$MODEL_DIR" --load-format dummy $WORKLOAD \
  --max-model-len 4096 --output-json "$OUT/offline-throughput.json" --disable-tqdm 2>&1 \
  | tail -25 | tee "$OUT/offline-throughput.txt"
# Batch-1 offline latency of a 128-token prompt, for the concurrency-1 comparison below.
python3 -m rooflm --log-level INFO bench latency --model "$MODEL_DIR" --load-format dummy --batch-size 1 \
  --input-len 128 --output-len 200 --num-iters 3 --num-iters-warmup 1 --max-model-len 4096 \
  --output-json "$OUT/offline-latency-b1.json" --disable-tqdm 2>&1 | tail -20 | tee "$OUT/offline-latency-b1.txt"

# (b) The server: engine core in its own process (the default); the queue holds all 1000 at once.
python3 -m rooflm --log-level INFO serve --model "$MODEL_DIR" --load-format dummy --max-model-len 4096 \
  --max-queued-requests 2000 --host 127.0.0.1 --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
trap 'kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null' EXIT
for _ in $(seq 600); do  # startup (model build, CUDA graphs) takes minutes at most
  curl -sf "$URL/health" > /dev/null && break
  kill -0 $SERVER_PID 2>/dev/null || { echo "server exited:"; tail -40 "$OUT/server.log"; exit 1; }
  sleep 1
done
curl -sf "$URL/health" > /dev/null || { echo "server not healthy:"; tail -40 "$OUT/server.log"; exit 1; }

BENCH="python3 -m rooflm bench serve --base-url $URL --model $NAME --vocab-size $VOCAB --ignore-eos \
  --request-timeout 900 --disable-tqdm"
# The same 1000 requests all at once (the offline comparison), then Poisson arrivals at 8/16/32 req/s.
# Per-process CPU use (top, 1 s samples) while it runs: the API process, the engine core, the client.
top -b -c -d 1 -w 220 > "$OUT/top-all-at-once.raw" 2>/dev/null &
TOP_PID=$!
$BENCH $WORKLOAD --request-rate inf --result-file "$OUT/serve-all-at-once.json" 2>&1 \
  | tee "$OUT/serve-all-at-once.txt"
kill $TOP_PID 2>/dev/null
grep -E "^top -|python" "$OUT/top-all-at-once.raw" | sed -E 's/ +/ /g' | cut -c1-200 > "$OUT/top-all-at-once.txt"
rm -f "$OUT/top-all-at-once.raw"
# Prompt seeds differ from the all-at-once run's (and per rate), so the prefix cache serves none.
$BENCH $WORKLOAD --request-rate $RATES --seed 1 --goodput ttft:500 tpot:30 --result-file "$OUT/serve-poisson.json" \
  --plot "$OUT/serve-poisson.png" 2>&1 | tee "$OUT/serve-poisson.txt"
# One request at a time, 128-token prompts: TTFT and end to end against the offline batch-1 run.
$BENCH --num-prompts $C1_PROMPTS --input-len 128 --output-len 200 --max-concurrency 1 --seed 100 \
  --result-file "$OUT/serve-concurrency1.json" 2>&1 | tee "$OUT/serve-concurrency1.txt"

# (c) Server / offline throughput on the same 1000 requests.
python3 - "$OUT" <<'PY' | tee "$OUT/ratio.txt"
import json, sys
out = sys.argv[1]
offline = json.load(open(f"{out}/offline-throughput.json"))
offline = offline.get("result", offline)
served = json.load(open(f"{out}/serve-all-at-once.json"))
for label, off_key, srv_key in (("requests/s", "requests_per_s", "request_throughput"),
                                ("output tokens/s", "output_tokens_per_s", "output_throughput")):
    o, s = offline[off_key], served[srv_key]
    print(f"{label:>16}: offline {o:10.1f}  server {s:10.1f}  server/offline {s / o:.3f}")
print(f"server failed requests: {served['failed']} of {served['num_prompts']}")
PY
