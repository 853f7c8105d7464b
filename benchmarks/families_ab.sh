#!/usr/bin/env bash
# Batch-1 TPOT of preset shapes (dummy bf16, 128 in / 128 out) on two source trees in one call,
# alternating: a fused-path change to the parts measured side by side with the code before it.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/families_ab.sh BASE_TREE PRESET...
#   BASE_TREE: a directory holding the other tree's rooflm/ (`git archive REV rooflm | tar -x -C _base`)
set -uo pipefail
BASE=$(cd "$1" && pwd); NEW=$PWD; shift
OUT=${OUT:-benchmarks/results/families-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for name in "$@"; do
  for side in new base; do
    tree=$NEW; [ "$side" = base ] && tree=$BASE
    (cd "$tree" && PYTHONPATH=$tree python -m rooflm bench latency --model "$name" --load-format dummy \
      --batch-size 1 --input-len 128 --output-len 128 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 \
      --disable-tqdm --output-json "$OUT/$name-$side.json") > "$OUT/$name-$side.txt" 2>&1
  done
done
python - "$OUT" "$@" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def row(name, side):
    try:
        d = json.loads((out / f"{name}-{side}.json").read_text())
        return f"{d['tpot_ms']['median']:.3f} ms, MBU {100 * d['mbu']:.1f}%"
    except (OSError, ValueError, KeyError, TypeError):
        return "missing"
print("| preset | new | base |\n| --- | ---: | ---: |")
for name in sys.argv[2:]:
    print(f"| {name} | {row(name, 'new')} | {row(name, 'base')} |")
PY
