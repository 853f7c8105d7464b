#!/usr/bin/env bash
# One device call (H100, < 8 min): --deterministic on the Llama-3-8B shape (dummy bf16).
#   1. the 48-request comparison: default vs --deterministic, identical outputs per comparison
#      (alone, preemption by recompute and swap, eager vs graphs, chunk 256 without prefix
#      cache, async scheduling off) -> compare-*.json
#   2. what --deterministic costs: batch-1 decode (128 in / 256 out), 64 x 1024/256 decode, the
#      1000-request ShareGPT-like offline workload, default and deterministic side by side (and
#      deterministic with the fixed split on, ROOFLM_DETERMINISTIC_MAX_SPLITS=8)
#   3. why: the persistent and fixed-split matmuls against cuBLAS, uniform attention against the decode kernel
# then a short table. Usage (GPU machine, repo root): OUT=dir bash benchmarks/deterministic.sh [compare|cost]
# (MODES="default deterministic" leaves out the fixed-split run.)
# (all: ~8 min on an H100, by estimate; compare and cost each fit a call on their own, same OUT.)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/deterministic}
mkdir -p "$OUT"
MODEL="--model llama-3-8b --load-format dummy"
PART=${1:-all}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null

if [ "$PART" != cost ]; then
  python benchmarks/deterministic.py --model llama-3-8b --out "$OUT" 2>&1 | grep -v "^WARNING\|Warn" \
    | tee "$OUT/compare.txt" | tail -16
fi
if [ "$PART" != compare ]; then
  [ -n "${SKIP_KERNELS:-}" ] || python benchmarks/deterministic_kernels.py --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/kernels.txt" | grep -v "^splits\|^loop tiles" | tail -60
  latency() {  # name, flags...
    local name=$1; shift
    python -m rooflm bench latency $MODEL "$@" --num-iters-warmup 1 --max-model-len 2048 --disable-tqdm \
      --output-json "$OUT/$name.json" 2>&1 | grep -v "^result written" | tail -6 > "$OUT/$name.txt"
  }
  throughput() {
    local name=$1; shift
    python -m rooflm bench throughput $MODEL --num-prompts 1000 --input-len 230 --output-len 200 \
      --range-ratio 0.9 --max-model-len 4096 --disable-tqdm "$@" --output-json "$OUT/$name.json" 2>&1 \
      | grep -v "^result written" | tail -12 > "$OUT/$name.txt"
  }
  # deterministic-split: the same mode with the fixed split on (ROOFLM_DETERMINISTIC_MAX_SPLITS=8;
  # off by default: every weight summed in the persistent matmul's single K loop).
  for mode in ${MODES:-default deterministic deterministic-split}; do
    flag=""; [ $mode != default ] && flag="--deterministic"
    splits=1; [ $mode = deterministic-split ] && splits=8
    export ROOFLM_DETERMINISTIC_MAX_SPLITS=$splits
    latency b1-$mode --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 $flag
    latency b64-$mode --batch-size 64 --input-len 1024 --output-len 256 --num-iters 2 $flag
    throughput sharegpt-$mode $flag
    echo "cost runs, $mode: done"
  done
  unset ROOFLM_DETERMINISTIC_MAX_SPLITS
fi

python - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
print("\n== --deterministic, Llama-3-8B shape (dummy bf16), 48 requests: identical outputs vs one batch ==")
for mode in ("default", "deterministic"):
    rec = load("compare-" + mode)
    if rec is None:
        continue
    for name, c in rec["variants"].items():
        print(f"{mode:13s} {name:36s} tokens {c['identical_tokens']:2d}/{c['requests']}  "
              f"+logprobs {c['identical_tokens_and_logprobs']:2d}/{c['requests']}  first diff {c['first_difference_at']}")
rows = [("batch-1 decode 128/256, TPOT ms", "b1", lambda d: d["tpot_ms"]["median"], False),
        ("64 x 1024/256, TPOT ms", "b64", lambda d: d["tpot_ms"]["median"], False),
        ("64 x 1024/256, TTFT ms (64 prefills)", "b64", lambda d: d["ttft_ms"]["median"], False),
        ("ShareGPT-like 1000, output tok/s", "sharegpt", lambda d: d["output_tokens_per_s"], True)]
print("\n== cost of --deterministic (same call) ==")
print(f"{'what':40s} {'default':>10s} {'determ.':>10s} {'cost':>7s} {'split on':>10s} {'cost':>7s}")
for label, name, get, higher_better in rows:
    a = load(name + "-default")
    if a is None:
        print(f"{label:40s} missing"); continue
    x = get(a)
    line = f"{label:40s} {x:10.2f}"
    for mode in ("deterministic", "deterministic-split"):
        b = load(f"{name}-{mode}")
        if b is None:
            line += f" {'-':>10s} {'-':>7s}"; continue
        y = get(b)
        cost = (x / y - 1) if higher_better else (y / x - 1)
        line += f" {y:10.2f} {cost:+7.1%}"
    print(line)
PY
