#!/usr/bin/env bash
# Same-call A/B of two source trees on one GPU: the ShareGPT-like offline row of traffic.sh quick,
# then batch-1 latency (Llama-3-8B shape, dummy bf16, 128 in / 256 out), alternating the trees.
# A refactor that must not move speed is checked this way (compare only within one call).
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/ab_trees.sh BASE_TREE
#   BASE_TREE: a directory holding the other tree's rooflm/ (e.g. `git archive REV rooflm | tar -x -C _base`)
set -uo pipefail
BASE=$(cd "$1" && pwd); NEW=$PWD
OUT=${OUT:-benchmarks/results/ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MODEL="--model llama-3-8b --load-format dummy"
SHAREGPT="--num-prompts 1000 --input-len 230 --output-len 200 --range-ratio 0.9 --max-model-len 4096"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
throughput() {  # name, tree
  (cd "$2" && PYTHONPATH=$2 python -m rooflm bench throughput $MODEL $SHAREGPT --disable-tqdm \
    --output-json "$OUT/$1.json") 2>&1 | grep -v "^result written" | tail -6 | tee "$OUT/$1.txt"
}
latency() {  # name, tree
  (cd "$2" && PYTHONPATH=$2 python -m rooflm bench latency $MODEL --batch-size 1 --input-len 128 \
    --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --disable-tqdm \
    --output-json "$OUT/$1.json") 2>&1 | grep -v "^result written" | tail -6 | tee "$OUT/$1.txt"
}
throughput sharegpt-new "$NEW"
throughput sharegpt-base "$BASE"
latency b1-new-1 "$NEW"
latency b1-base-1 "$BASE"
latency b1-new-2 "$NEW"
latency b1-base-2 "$BASE"
python - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
def tput(name):
    d = load(name)
    return "missing" if d is None else f"{d['output_tokens_per_s']:,.1f}"
def tpot(name):
    d = load(name)
    return "missing" if d is None or not d.get("tpot_ms") else f"{d['tpot_ms']['median']:.3f}"
print("| run | new | base |\n| --- | ---: | ---: |")
print(f"| ShareGPT-like offline, output tok/s | {tput('sharegpt-new')} | {tput('sharegpt-base')} |")
for i in (1, 2):
    print(f"| batch-1 128/256, median TPOT ms, pass {i} | {tpot(f'b1-new-{i}')} | {tpot(f'b1-base-{i}')} |")
PY
