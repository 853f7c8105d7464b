#!/usr/bin/env bash
# Issue 21, batch 1: what each of the decode-step changes does to --deterministic's batch-1 TPOT
# (Llama-3-8B shape, dummy bf16, 128 in / 256 out), one process a variant, side by side in one
# device call, the default mode first. Variants switch one thing at a time:
#   ROOFLM_DETERMINISTIC_GATED_MAX_M  gate_up + SiLU-mul fused for decode-size steps (0: off)
#   ROOFLM_MATMUL_PREFETCH            bytes of each W row the persistent matmul prefetches into L2
#                                     before its PDL wait (0: off)
#   ROOFLM_ATTENTION_PREFETCH_KEYS    keys whose K/V the uniform attention prefetches before its wait
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/deterministic_b1.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/deterministic-b1}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
run() {  # name, env..., then --
  local name=$1; shift
  env "$@" python -m rooflm bench latency --model llama-3-8b --load-format dummy --batch-size 1 --input-len 128 \
    --output-len 256 --num-iters 3 --num-iters-warmup 1 --max-model-len 2048 --disable-tqdm \
    $([ "$name" != default ] && echo --deterministic) --output-json "$OUT/b1-$name.json" > "$OUT/b1-$name.txt" 2>&1
}
OFF="ROOFLM_DETERMINISTIC_GATED_MAX_M=0 ROOFLM_MATMUL_PREFETCH=0 ROOFLM_ATTENTION_PREFETCH_KEYS=0"
for variant in ${VARIANTS:-default none gated gated+mm gated+mm+attn gated+mm4k+attn}; do
  case $variant in
    default)          run default ;;
    none)             run none $OFF ;;
    gated)            run gated $OFF ROOFLM_DETERMINISTIC_GATED_MAX_M=64 ;;
    gated+mm)         run gated+mm $OFF ROOFLM_DETERMINISTIC_GATED_MAX_M=64 ROOFLM_MATMUL_PREFETCH=1024 ;;
    gated+mm+attn)    run gated+mm+attn ;;  # the defaults: all three on
    gated+mm4k+attn)  run gated+mm4k+attn ROOFLM_MATMUL_PREFETCH=4096 ;;
  esac
done
python - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
base = None
print(f"{'variant':18s} {'TPOT ms':>8s} {'vs default':>10s}")
for name in ("default", "none", "gated", "gated+mm", "gated+mm+attn", "gated+mm4k+attn"):
    p = os.path.join(out, f"b1-{name}.json")
    if not os.path.exists(p):
        continue
    t = json.load(open(p))["tpot_ms"]["median"]
    base = base or t
    print(f"{name:18s} {t:8.3f} {t / base - 1:+10.1%}")
PY
