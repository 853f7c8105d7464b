#!/usr/bin/env bash
# Batch-1 latency (Llama-3-8B shape, dummy bf16, 128 in / 256 out) of several source trees in one
# call, one after another, then the first again: a bisect of a TTFT or TPOT shift between commits.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/ab_latency.sh TREE_DIR...
#   each TREE_DIR holds one tree's rooflm/ (e.g. `git archive REV rooflm | tar -x -C _ab/REV`)
set -uo pipefail
OUT=${OUT:-benchmarks/results/ab-latency}
ITERS=${ITERS:-10}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
trees=("$@" "$1")
for i in "${!trees[@]}"; do
  tree=$(cd "${trees[$i]}" && pwd); name="$i-$(basename "$tree")"
  (cd "$tree" && PYTHONPATH=$tree python -m rooflm bench latency --model llama-3-8b --load-format dummy \
    --batch-size 1 --input-len 128 --output-len 256 --num-iters "$ITERS" --num-iters-warmup 2 \
    --max-model-len 2048 --disable-tqdm --output-json "$OUT/$name.json") > "$OUT/$name.txt" 2>&1
done
python - "$OUT" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
print("| run | TTFT median ms | TTFT mean ms | TPOT median ms |\n| --- | ---: | ---: | ---: |")
for f in sorted(out.glob("*.json"), key=lambda p: int(p.stem.split("-")[0])):
    d = json.loads(f.read_text())
    ttfts = [it["ttft_s"] * 1e3 for it in d["iterations"]]
    print(f"| {f.stem} | {d['ttft_ms']['median']:.3f} | {statistics.mean(ttfts):.3f} | {d['tpot_ms']['median']:.3f} |")
PY
