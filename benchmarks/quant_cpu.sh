#!/usr/bin/env bash
# Accuracy of quantization on the CPU: SmolLM2-135M-Instruct (the embedded default) in fp32
# against quantized variants, perplexity and drift on pydoc_data/topics.py (16 windows of 512
# tokens; GPTQ and AWQ calibrate on windows 32.. of the same file, never on the scored ones).
# Writes OUT/{ppl-*.json,*.txt,drift-*.txt}.
# WINDOWS=N (default 16) scores the first N windows (`eval ppl --max-windows N`; from window 0 at most 32, where the
# calibration starts: eval ppl refuses more); with N other than 16 every ppl/drift/quantize file,
# the fp32 reference's included, is named with -Nw, so 16- and N-window results never mix.
# FIRST_WINDOW=F (default 0) scores windows F..F+N-1 instead (`eval ppl --first-window F`; eval ppl refuses a
# range that overlaps quantize's default calibration windows, 32..39); with F other than 0 every file is named
# -wF-L (L = F+N-1, the last window), e.g. FIRST_WINDOW=64 WINDOWS=271 -> -w64-334, the text's last 271 windows,
# clear of the --calib-windows 32 rows' calibration (windows 32..63).
# KEEP=1 keeps each quantized checkpoint (OUT/RUN) and reuses one already there instead of quantizing again
# (to score one checkpoint on two window ranges); without it the checkpoint is deleted after scoring.
# Usage: OUT=dir [WINDOWS=32] [FIRST_WINDOW=64] [KEEP=1] bash benchmarks/quant_cpu.sh [RUN...]   (~1 h on a loaded 2-core machine for all)
#   RUN: int8-rtn int4-g128-rtn int4-g128-gptq int4-g128-gptq-ao-mse (the default set, 2026-11-23)
#        fp8 int4-g128-awq int4-g128-awq-gptq int4-g32-awq-gptq int4-g128-awq-gptq-duo
#        int4-g128-awq-gptq-score int4-g32-awq-gptq-score (2026-11-25; -score: AWQ scored with GPTQ,
#        today's awq+gptq default); int4-g128-gptq-ao-mse-seq int4-g128-awq-gptq-score-seq
#        int4-g32-awq-gptq-score-seq (sequential GPTQ; the rows before pass --no-sequential)
#        int4-g128-awq-gptq-block int4-g128-awq-block (AWQ scored on the block's output)
#        int4-g128-awq-gptq-block-seq (... searched on the quantized model's own inputs);
#        int4-g128-awq-gptq-score-c128 int4-g128-awq-gptq-block-seq-c128 (128 calibration windows);
#        int4-g128-awq-gptq-score-refit (GPTQ's scales refit, --refit);
#        int4-g128-awq-gptq-score-skipqk (no range shrink on q/k rows, --mse-skip-qk), int4-g128-awq-gptq-score-skipqk-refit
#        int4-g128-awq-gptq-skipqk-damp10 int4-g128-awq-gptq-skipqk-damp001 (GPTQ damping 0.1 / 0.001, --damp)
#        int4-g128-awq-gptq-skipqk-c64 (64 calibration windows) (2026-11-27: the skip-qk row's flags, one change each)
#        int4-g128-gptq-ao-mse-v2 int4-g128-gptq-ao-mse-v2a1 int4-g128-gptq-ao-mse-skipqk-v2 int4-g128-awq-gptq-skipqk-v2 int4-g128-awq-gptq-skipqk-v2a1
#        (GPTQv2's asymmetric calibration, --gptq-v2, alpha 0.25 / 1; 2026-11-27 s25)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/quant-cpu-$(date -u +%Y%m%d)}
PY=${PY:-.venv/bin/python}
WINDOWS=${WINDOWS:-16}
FIRST_WINDOW=${FIRST_WINDOW:-0}
KEEP=${KEEP:-0}
W=""; [ "$WINDOWS" != 16 ] && W="-${WINDOWS}w"  # file-name suffix
[ "$FIRST_WINDOW" != 0 ] && W="-w${FIRST_WINDOW}-$((FIRST_WINDOW + WINDOWS - 1))"
RANGE=(--max-windows "$WINDOWS"); [ "$FIRST_WINDOW" != 0 ] && RANGE+=(--first-window "$FIRST_WINDOW")
mkdir -p "$OUT"
uptime | tee -a "$OUT/load-start$W.txt"
if [ ! -f "$OUT/ppl-fp32$W.json" ]; then
  $PY -m rooflm eval ppl --quantization none --dtype float32 --device cpu "${RANGE[@]}" \
    --output-json "$OUT/ppl-fp32$W.json" > "$OUT/ppl-fp32$W.txt" 2>&1 || { cat "$OUT/ppl-fp32$W.txt" >&2; exit 1; }
fi
score() {  # name, eval ppl flags...
  local name=$1; shift
  $PY -m rooflm eval ppl "$@" --dtype float32 --device cpu "${RANGE[@]}" --output-json "$OUT/ppl-$name$W.json" > "$OUT/ppl-$name$W.txt" 2>&1
  $PY -m rooflm eval drift "$OUT/ppl-fp32$W.json" "$OUT/ppl-$name$W.json" > "$OUT/drift-$name$W.txt"
  echo "$name: $(grep perplexity "$OUT/drift-$name$W.txt")"
}
run() {  # name, quantize flags...
  local name=$1; shift
  if [ "$KEEP" = 1 ] && [ -f "$OUT/$name/config.json" ]; then
    echo "reusing the kept checkpoint $OUT/$name (KEEP=1; see its quantize log)" > "$OUT/quantize-$name$W.txt"
  else
    $PY -m rooflm quantize --output "$OUT/$name" "$@" > "$OUT/quantize-$name$W.txt" 2>&1
  fi
  score "$name" --model "$OUT/$name"
  [ "$KEEP" = 1 ] || rm -rf "${OUT:?}/$name"  # the checkpoint itself (~100 MB) is not kept
}
one() {
  case $1 in
    int8-rtn) run int8-rtn --scheme int8 --method rtn ;;
    int4-g128-rtn) run int4-g128-rtn --scheme int4-g128 --method rtn ;;
    int4-g128-gptq) run int4-g128-gptq --scheme int4-g128 --method gptq --no-sequential ;;
    int4-g128-gptq-ao-mse) run int4-g128-gptq-ao-mse --scheme int4-g128 --method gptq --act-order --mse --calib-windows 32 --no-sequential ;;
    # FP8 W8A8 at load: per-output-channel e4m3 weights, dynamic per-token e4m3 activations
    # (real fp8 rounding on the CPU through torch.float8_e4m3fn casts).
    fp8) score fp8 --quantization fp8 ;;
    int4-g128-awq) run int4-g128-awq --scheme int4-g128 --method awq --calib-windows 32 ;;
    int4-g128-awq-gptq) run int4-g128-awq-gptq --scheme int4-g128 --method awq+gptq --act-order --mse --calib-windows 32 --awq-score rtn --no-sequential ;;
    int4-g32-awq-gptq) run int4-g32-awq-gptq --scheme int4-g32 --method awq+gptq --act-order --mse --calib-windows 32 --awq-score rtn --no-sequential ;;
    int4-g128-awq-gptq-score) run int4-g128-awq-gptq-score --scheme int4-g128 --method awq+gptq --act-order --mse --calib-windows 32 --awq-score gptq --no-sequential ;;
    int4-g32-awq-gptq-score) run int4-g32-awq-gptq-score --scheme int4-g32 --method awq+gptq --act-order --mse --calib-windows 32 --awq-score gptq --no-sequential ;;
    int4-g128-awq-gptq-duo) run int4-g128-awq-gptq-duo --scheme int4-g128 --method awq+gptq --act-order --mse --calib-windows 32 --duo --awq-score rtn --no-sequential ;;
    # Sequential GPTQ (2026-11-25, --method gptq's default since): each linear calibrated on the quantized
    # predecessors' outputs (rooflm/quantize/sequential.py).
    int4-g128-gptq-ao-mse-seq) run int4-g128-gptq-ao-mse-seq --scheme int4-g128 --method gptq --act-order --mse --calib-windows 32 --sequential ;;
    int4-g128-awq-gptq-score-seq) run int4-g128-awq-gptq-score-seq --scheme int4-g128 --method awq+gptq --act-order --mse --calib-windows 32 --awq-score gptq --sequential ;;
    int4-g32-awq-gptq-score-seq) run int4-g32-awq-gptq-score-seq --scheme int4-g32 --method awq+gptq --act-order --mse --calib-windows 32 --awq-score gptq --sequential ;;
    # AWQ scored on the block's output (llm-awq's objective, rooflm/quantize/awq_block.py; 2026-11-25 s9).
    int4-g128-awq-gptq-block) run int4-g128-awq-gptq-block --scheme int4-g128 --method awq+gptq --act-order --mse --calib-windows 32 --awq-score gptq --awq-objective block --no-sequential ;;
    int4-g128-awq-gptq-block-seq) run int4-g128-awq-gptq-block-seq --scheme int4-g128 --method awq+gptq --act-order --mse --calib-windows 32 --awq-score gptq --awq-objective block --awq-inputs quantized ;;
    # More calibration text: 128 windows (65,536 tokens) instead of 32.
    int4-g128-awq-gptq-score-c128) run int4-g128-awq-gptq-score-c128 --scheme int4-g128 --method awq+gptq --act-order --mse --calib-windows 128 --awq-score gptq --no-sequential ;;
    int4-g128-awq-gptq-block-seq-c128) run int4-g128-awq-gptq-block-seq-c128 --scheme int4-g128 --method awq+gptq --act-order --mse --calib-windows 128 --awq-score gptq --awq-objective block --awq-inputs quantized ;;
    # GPTQ's group scales refit to the least output error for its codes (gptq.refit_group_scales).
    int4-g128-awq-gptq-score-refit) run int4-g128-awq-gptq-score-refit --scheme int4-g128 --method awq+gptq --act-order --mse --refit --calib-windows 32 --awq-score gptq --no-sequential ;;
    # GPTQ's --mse range search kept off the q/k rows (gptq.range_search_rows; AWQ's clip search skips q/k).
    int4-g128-awq-gptq-score-skipqk) run int4-g128-awq-gptq-score-skipqk --scheme int4-g128 --method awq+gptq --act-order --mse --mse-skip-qk --calib-windows 32 --awq-score gptq --no-sequential ;;
    int4-g128-awq-gptq-score-skipqk-refit) run int4-g128-awq-gptq-score-skipqk-refit --scheme int4-g128 --method awq+gptq --act-order --mse --mse-skip-qk --refit --calib-windows 32 --awq-score gptq --no-sequential ;;
    # GPTQ's damping (--damp, percdamp / damp_percent: a fraction of the mean Hessian diagonal; default 0.01) on the skip-qk row.
    int4-g128-awq-gptq-skipqk-damp10) run int4-g128-awq-gptq-skipqk-damp10 --scheme int4-g128 --method awq+gptq --act-order --mse --mse-skip-qk --damp 0.1 --calib-windows 32 --awq-score gptq --no-sequential ;;
    int4-g128-awq-gptq-skipqk-damp001) run int4-g128-awq-gptq-skipqk-damp001 --scheme int4-g128 --method awq+gptq --act-order --mse --mse-skip-qk --damp 0.001 --calib-windows 32 --awq-score gptq --no-sequential ;;
    # The skip-qk row with 64 calibration windows (32,768 tokens) instead of 32.
    int4-g128-awq-gptq-skipqk-c64) run int4-g128-awq-gptq-skipqk-c64 --scheme int4-g128 --method awq+gptq --act-order --mse --mse-skip-qk --calib-windows 64 --awq-score gptq --no-sequential ;;
    # GPTQv2's asymmetric calibration (--gptq-v2: each linear fitted to the float model's outputs, fed the quantized
    # model's inputs; gptq.asymmetric_target), alpha 0.25 (GPTQModel's default) and 1 (the full least-squares target).
    int4-g128-gptq-ao-mse-v2) run int4-g128-gptq-ao-mse-v2 --scheme int4-g128 --method gptq --act-order --mse --calib-windows 32 --gptq-v2 ;;
    int4-g128-gptq-ao-mse-v2a1) run int4-g128-gptq-ao-mse-v2a1 --scheme int4-g128 --method gptq --act-order --mse --calib-windows 32 --gptq-v2 --gptq-v2-alpha 1 ;;
    int4-g128-gptq-ao-mse-skipqk-v2) run int4-g128-gptq-ao-mse-skipqk-v2 --scheme int4-g128 --method gptq --act-order --mse --mse-skip-qk --calib-windows 32 --gptq-v2 ;;
    int4-g128-awq-gptq-skipqk-v2) run int4-g128-awq-gptq-skipqk-v2 --scheme int4-g128 --method awq+gptq --act-order --mse --mse-skip-qk --calib-windows 32 --awq-score gptq --gptq-v2 ;;
    int4-g128-awq-gptq-skipqk-v2a1) run int4-g128-awq-gptq-skipqk-v2a1 --scheme int4-g128 --method awq+gptq --act-order --mse --mse-skip-qk --calib-windows 32 --awq-score gptq --gptq-v2 --gptq-v2-alpha 1 ;;
    int4-g128-awq-block) run int4-g128-awq-block --scheme int4-g128 --method awq --calib-windows 32 --awq-objective block ;;
    *) echo "unknown run $1" >&2; return 2 ;;
  esac
}
RUNS=("$@")
[ ${#RUNS[@]} -eq 0 ] && RUNS=(int8-rtn int4-g128-rtn int4-g128-gptq int4-g128-gptq-ao-mse)
for r in "${RUNS[@]}"; do one "$r"; done
uptime | tee -a "$OUT/load-end$W.txt"
