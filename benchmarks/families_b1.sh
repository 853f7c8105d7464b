#!/usr/bin/env bash
# Batch-1 decode of several families' real shapes (dummy bf16 weights) in one call: median TPOT and
# MBU from `bench latency` (128 in / 128 out), one row per preset, CUDA graphs on.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/families_b1.sh PRESET...
set -uo pipefail
OUT=${OUT:-benchmarks/results/families-b1}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for name in "$@"; do
  PYTHONPATH=$PWD python -m rooflm bench latency --model "$name" --load-format dummy --batch-size 1 \
    --input-len 128 --output-len 128 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 \
    --disable-tqdm --output-json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1 || echo "$name failed: $(tail -3 "$OUT/$name.txt")"
done
python - "$OUT" "$@" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| preset | median TPOT ms | MBU | output tok/s |\n| --- | ---: | ---: | ---: |")
for name in sys.argv[2:]:
    try:
        d = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        print(f"| {name} | missing | | |")
        continue
    mbu = d.get("mbu")
    mbu = f"{100 * mbu:.1f}%" if isinstance(mbu, (int, float)) else str(mbu)
    tps = d.get("output_tokens_per_s", 0)
    tps = tps["median"] if isinstance(tps, dict) else tps  # bench latency writes {median, mean, min, max}
    print(f"| {name} | {d['tpot_ms']['median']:.3f} | {mbu} | {tps:,.1f} |")
PY
