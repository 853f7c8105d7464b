#!/usr/bin/env bash
# One device call (~6 minutes on an H100; GPU=h200 on an H200): how well `rooflm simulate` predicts real serving.
#   1. `rooflm simulate --calibrate` on the Llama-3-8B shape (dummy weights): the calibration table;
#   2. the offline engine on ShareGPT-like traffic (`rooflm bench throughput`, as benchmarks/traffic.sh);
#   3. `rooflm serve` + `rooflm bench serve` on the same kind of traffic at three Poisson rates: low,
#      near saturation, overloaded (as benchmarks/serving.sh runs serving);
#   4. the simulator on exactly those workloads (the result files' send times and lengths), and a
#      table of simulated vs measured throughput and median/P99 TTFT and TPOT with the errors;
#   5. if time is left, docs/simulate.md's 1000 req/s plan priced with this calibration.
# The table $OUT/calibration-$GPU-llama-3-8b.json is what rooflm/sim/calibrations/ ships (copy it
# there as $GPU-llama-3-8b-dummy.json to make it the default for that GPU, and the closest measured
# correction for other GPUs).
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/simulate_fidelity.sh
#   Carry .whl/ (benchmarks/fetch_serving_wheels.sh: the GPU machine has no server stack) and
#   benchmarks/models/llama-3-8b-dummy (benchmarks/make_dummy_model_dir.py; made here if missing).
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/simulate-fidelity}
MODEL_DIR=${MODEL_DIR:-benchmarks/models/llama-3-8b-dummy}
PORT=${PORT:-8124}
URL=http://127.0.0.1:$PORT
# ShareGPT-like lengths (~230 in / ~200 out, +-90%), as serving.sh and traffic.sh use.
WORKLOAD=${WORKLOAD:-"--num-prompts 1000 --input-len 230 --output-len 200 --range-ratio 0.9"}
RATES=${RATES:-"16 45 80"}  # low, near saturation (~45 req/s measured), overloaded
# For a CPU smoke run of the script itself: MAX_LEN=512 CAL_FLAGS="--gpu h100 --device cpu" and a
# tiny MODEL_DIR, WORKLOAD and RATES.
MAX_LEN=${MAX_LEN:-4096}
CAL_FLAGS=${CAL_FLAGS:-}
mkdir -p "$OUT"
T0=$(date +%s)
{ date -Is; git rev-parse HEAD 2>/dev/null; python3 --version
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv; } | tee "$OUT/env.txt"
[ -f "$MODEL_DIR/config.json" ] || python3 benchmarks/make_dummy_model_dir.py --preset llama-3-8b --out "$MODEL_DIR"
NAME=$(basename "$MODEL_DIR")
VOCAB=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL_DIR/config.json")
GPU=${GPU:-h100}  # names the table: the GPU this call runs on
CAL="$OUT/calibration-$GPU-llama-3-8b.json"

# (1) Calibration: real engine steps over a grid of batch sizes and context lengths.
python3 -m rooflm --log-level INFO simulate --calibrate --model "$MODEL_DIR" --load-format dummy \
  --max-model-len $MAX_LEN $CAL_FLAGS --calibration-out "$CAL" 2>&1 | grep -v "^INFO" | tee "$OUT/calibrate.txt"
echo "calibration done at +$(( $(date +%s) - T0 )) s"

# (2) Offline: the engine in-process, 1000 requests at once.
python3 -m rooflm bench throughput --model "$MODEL_DIR" --load-format dummy $WORKLOAD --max-model-len $MAX_LEN \
  --output-json "$OUT/offline-throughput.json" --disable-tqdm 2>&1 | tail -14 | tee "$OUT/offline-throughput.txt"
echo "offline done at +$(( $(date +%s) - T0 )) s"

# (3) Serving at three rates.
python3 -m rooflm --log-level INFO serve --model "$MODEL_DIR" --load-format dummy --max-model-len $MAX_LEN \
  --max-queued-requests 4000 --host 127.0.0.1 --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
trap 'kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null' EXIT
for _ in $(seq 300); do
  curl -sf "$URL/health" > /dev/null && break
  kill -0 $SERVER_PID 2>/dev/null || { echo "server exited:"; tail -40 "$OUT/server.log"; exit 1; }
  sleep 1
done
curl -sf "$URL/health" > /dev/null || { echo "server not healthy:"; tail -40 "$OUT/server.log"; exit 1; }
# Four client processes: the client's own load (one process: 50% busy at 80 req/s) out of the TTFT.
# PASSES=2 serves the three rates a second time (files serve-p2-rate*.json): past saturation one
# run's P99 TTFT has moved by 2x between calls, so a second pass says how far it moves within one.
for pass in $(seq ${PASSES:-1}); do
  tag=""; [ "$pass" -gt 1 ] && tag="-p$pass"
  python3 -m rooflm bench serve --base-url $URL --model $NAME --vocab-size $VOCAB --ignore-eos \
    --client-processes ${CLIENTS:-4} \
    --request-timeout 900 --disable-tqdm $WORKLOAD --request-rate $RATES --seed 1 --goodput ttft:500 tpot:30 \
    --result-file "$OUT/serve$tag.json" 2>&1 | tail -8 | tee "$OUT/serve$tag.txt"
done
kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null
echo "serving done at +$(( $(date +%s) - T0 )) s"

# (4) The simulator on the same workloads.
SERVE_FILES=""
for r in $RATES; do SERVE_FILES="$SERVE_FILES $OUT/serve-rate$r.json"; done
python3 benchmarks/simulate_fidelity.py --calibration "$CAL" --model-dir "$MODEL_DIR" --serve $SERVE_FILES \
  --offline "$OUT/offline-throughput.json" --max-model-len $MAX_LEN --out "$OUT" 2>&1 | tee "$OUT/simulate.txt" | grep -v "^|" | tail -60
for pass in $(seq 2 ${PASSES:-1}); do
  SERVE_FILES=""
  for r in $RATES; do SERVE_FILES="$SERVE_FILES $OUT/serve-p$pass-rate$r.json"; done
  python3 benchmarks/simulate_fidelity.py --calibration "$CAL" --model-dir "$MODEL_DIR" --serve $SERVE_FILES \
    --max-model-len $MAX_LEN --out "$OUT/p$pass" 2>&1 | tee "$OUT/simulate-p$pass.txt" | grep -v "^|" | tail -30
done
echo "fidelity done at +$(( $(date +%s) - T0 )) s"

# (5) If time is left: docs/simulate.md's plan beyond one machine, priced with this calibration.
if [ $(( $(date +%s) - T0 )) -lt ${PLAN_BEFORE_S:-380} ]; then
  timeout ${PLAN_TIMEOUT_S:-150} python3 -m rooflm simulate --plan --model llama-3-8b --calibration "$CAL" --rate 1000 \
    --slo ttft_p99=500ms,tpot_p50=30ms --gpus h100,h200 --tp-options 1,2 --num-prompts 500 \
    --max-model-len 4096 2>&1 | tee "$OUT/plan-1000rps.txt" | tail -9
fi
echo "total $(( $(date +%s) - T0 )) s"
cat "$OUT/fidelity.md"
