#!/usr/bin/env bash
# Issue 54's three targets in one device call (H200, Llama-3-8B shape, dummy weights), in order:
#   1. multi-turn chat, host KV tier on/off      benchmarks/multi_turn_prefix.py   (~3 min)
#   2. overload 1.5x: priority and SLO shedding  benchmarks/overload_priority.py   (~3 min)
#   3. sleep/wake to first token                 benchmarks/sleep_wake.py          (~1 min)
# Each step runs under `timeout` so that one overrun leaves the others' results; JSON, logs and
# README-ready tables go under $OUT (service-levels.md gathers the tables).
# Usage (GPU machine, repo root; carry .whl/ from benchmarks/fetch_serving_wheels.sh):
#   OUT=dir bash benchmarks/service_levels.sh
# MODEL: the in-process engine's model (multi-turn), default the llama-3-8b preset. MODEL_DIR: what
# the servers serve, a directory with config.json and tokenizer files (per-token streaming needs
# text), default benchmarks/models/llama-3-8b-dummy: make it before the device call, where the
# tokenizer source is installed (git-ignored: name it in the device call's carry):
#   python benchmarks/make_dummy_model_dir.py --preset llama-3-8b --out benchmarks/models/llama-3-8b-dummy
# One step, or some (STEPS, names as below), and more flags for step 2 (OP_ARGS), e.g. step 2's
# goodput part alone, the capacity taken from an earlier run (no burst; ~2.5 min):
#   OUT=dir STEPS=overload_priority T2=300 OP_ARGS="--parts goodput --capacity-req-s 53.4 --duration-s 10" \
#     bash benchmarks/service_levels.sh
# CPU smoke run of the script itself (numbers mean nothing), MODEL_DIR a tiny model with a tokenizer:
#   OUT=/tmp/sl MODEL=DIR MODEL_DIR=DIR DEVICE=cpu SMOKE=1 bash benchmarks/service_levels.sh
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true  # an overload holds over a thousand sockets
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/service-levels}
MODEL=${MODEL:-llama-3-8b}
MODEL_DIR=${MODEL_DIR:-benchmarks/models/llama-3-8b-dummy}
[ -f "$MODEL_DIR/config.json" ] || $PY benchmarks/make_dummy_model_dir.py --preset llama-3-8b --out "$MODEL_DIR" \
  || { echo "no $MODEL_DIR: make it where the tokenizer source is (see above)"; }
DEVICE_FLAG=${DEVICE:+--device $DEVICE}
T1=${T1:-230} T2=${T2:-220} T3=${T3:-100}  # seconds per step; the sum (550) stays under a 600 s call
mkdir -p "$OUT"
{ date -Is; git rev-parse HEAD 2>/dev/null; $PY --version
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>/dev/null; } | tee "$OUT/env.txt"

if [ -n "${SMOKE:-}" ]; then  # tiny counts: the scripts run end to end, nothing more
  MT="--conversations 4 --turns 2 --system-len 32 --user-len 8 --answer-len 4"
  OP="--input-len 16 --output-len 4 --capacity-requests 6 --duration-s 3 --client-processes 1 --warmup-requests 2
      --ttft-slo-ms 5000 --tpot-slo-ms 5000"
  SW="--cycles 1 --output-len 4 --input-len 16"
else
  MT="" OP="" SW=""
fi

STEPS=${STEPS:-multi_turn_prefix overload_priority sleep_wake}
OP="$OP ${OP_ARGS:-}"

step() {  # name, seconds, command...: run under timeout, keep going on failure
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${limit}s) ==="
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc $rc in $((SECONDS - t0)) s ===" | tee -a "$OUT/$name.txt"
}

step multi_turn_prefix "$T1" $PY benchmarks/multi_turn_prefix.py --model "$MODEL" --load-format dummy $DEVICE_FLAG \
  $MT --out "$OUT/multi_turn_prefix.json"
step overload_priority "$T2" $PY benchmarks/overload_priority.py --model "$MODEL_DIR" --load-format dummy $DEVICE_FLAG \
  $OP --log-dir "$OUT" --out "$OUT/overload_priority.json"
step sleep_wake "$T3" $PY benchmarks/sleep_wake.py --model "$MODEL_DIR" --load-format dummy $DEVICE_FLAG \
  $SW --log-dir "$OUT" --out "$OUT/sleep_wake.json"

# The README-ready tables, in one file: each script writes its table into its JSON.
$PY - "$OUT" "$STEPS" <<'PY' | tee "$OUT/service-levels.md"
import json, os, sys
out, steps = sys.argv[1], sys.argv[2].split()
print("## Service levels (issue 54): " + open(os.path.join(out, "env.txt")).read().splitlines()[0])
for name in steps:
    path = os.path.join(out, name + ".json")
    print(f"\n### {name}\n")
    if not os.path.exists(path):
        print(f"no result: see {name}.txt (failed or ran out of time)")
        continue
    print(json.load(open(path))["table"])
PY
