#!/usr/bin/env bash
# Accuracy of weight-only quantization on the CPU: SmolLM2-135M-Instruct (the embedded default) in
# fp32 against int8 per-channel RTN, int4 g128 RTN and int4 g128 GPTQ, perplexity and drift on
# pydoc_data/topics.py (16 windows of 512 tokens; GPTQ calibrates on windows 32.. of the same
# file, never on the scored ones). Writes OUT/{ppl-*.json,*.txt,drift-*.txt,README.md}.
# Usage: OUT=dir bash benchmarks/quant_cpu.sh     (~1 h on a loaded 2-core machine)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/quant-cpu-$(date -u +%Y%m%d)}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
uptime | tee "$OUT/load-start.txt"
$PY -m rooflm eval ppl --quantization none --dtype float32 --device cpu --output-json "$OUT/ppl-fp32.json" > "$OUT/ppl-fp32.txt" 2>&1
run() {  # name, quantize flags...
  local name=$1; shift
  $PY -m rooflm quantize --output "$OUT/$name" "$@" > "$OUT/quantize-$name.txt" 2>&1
  $PY -m rooflm eval ppl --model "$OUT/$name" --dtype float32 --device cpu --output-json "$OUT/ppl-$name.json" \
    > "$OUT/ppl-$name.txt" 2>&1
  $PY -m rooflm eval drift "$OUT/ppl-fp32.json" "$OUT/ppl-$name.json" > "$OUT/drift-$name.txt"
  rm -rf "${OUT:?}/$name"  # the checkpoint itself (~100 MB) is not kept
  echo "$name: $(grep perplexity "$OUT/drift-$name.txt")"
}
run int8-rtn --scheme int8 --method rtn
run int4-g128-rtn --scheme int4-g128 --method rtn
run int4-g128-gptq --scheme int4-g128 --method gptq
run int4-g128-gptq-ao-mse --scheme int4-g128 --method gptq --act-order --mse --calib-windows 32
uptime | tee "$OUT/load-end.txt"
