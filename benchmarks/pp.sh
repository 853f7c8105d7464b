#!/usr/bin/env bash
# Pipeline parallelism on 2 GPUs of one host (the nvidia-h200-x2 kind), one call of under 9 minutes:
#   1. the GPU tests (tests/distributed/test_pp_gpu.py: PP=2 greedy tokens == PP=1, one step at a
#      time and two batches in flight);
#   2. offline N x 1024/1024 (N=${PP_PROMPTS:-256}), Llama-3-8B shape, dummy bf16: TP=1, PP=2 with two
#      batches in flight (the default), PP=2 one step at a time (--pipeline-micro-batches 1), TP=2;
#   3. batch-1 decode 128/256: TP=1, PP=2 (a batch of one cannot be split: PP adds a hop, not speed).
# PP runs eagerly (no CUDA graphs under PP yet), so TP=1 and TP=2 run twice: with their graphs (what
# a user gets) and --enforce-eager (the same kernels as PP). Every step runs under `timeout`
# within BUDGET_S; a step that would not fit is skipped and says so. $OUT ends with summary.md,
# results.json and logs.tar.gz.
# The runs go in order of value (PP=2, TP=1 eager, PP=2 one at a time, TP=2 eager, then the graph runs
# and batch-1); a second call can take the rest: SKIP_TESTS=1 RUNS="tp1 tp2" (RUNS: which offline runs).
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/pp.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NCCL_DEBUG=WARN ROOFLM_HANG_DUMP_S=120
OUT=${OUT:-benchmarks/results/pp}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
BUDGET_S=${BUDGET_S:-560}
MODEL="--model llama-3-8b --load-format dummy --max-model-len 2048"
N=${PP_PROMPTS:-256}
SUMMARY="$OUT/summary.md"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

step() {  # NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - SECONDS ))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then say "- $name: skipped (budget spent: ${SECONDS} s of $BUDGET_S)"; return 99; fi
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  local rc=$?
  local note=""
  (( rc == 124 || rc == 137 )) && note=" TIMED OUT after $limit s"
  say "- $name: rc $rc, $(( SECONDS - t0 )) s$note"
  return $rc
}

say "# benchmarks/pp.sh, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)"
say "GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | tr '\n' ';')"
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then say "benchmarks/pp.sh needs 2 GPUs"; exit 1; fi
[ -n "${SKIP_TESTS:-}" ] || step gpu-tests 130 python -m pytest -q -p no:cacheprovider -m gpu -s tests/distributed/test_pp_gpu.py

throughput() {  # NAME FLAGS...
  local name=$1; shift
  step "throughput-$name" 80 python -m rooflm bench throughput $MODEL "$@" --num-prompts "$N" \
    --input-len 1024 --output-len 1024 --disable-tqdm --output-json "$LOGS/throughput-$name.json"
}
for run in ${RUNS:-pp2 tp1-eager pp2-sync tp2-eager tp1 tp2}; do
  case $run in
    pp2) throughput pp2 --pipeline-parallel-size 2 ;;
    pp2-sync) throughput pp2-sync --pipeline-parallel-size 2 --pipeline-micro-batches 1 ;;
    tp1-eager) throughput tp1-eager --enforce-eager ;;
    tp2-eager) throughput tp2-eager --tensor-parallel-size 2 --enforce-eager ;;
    tp1) throughput tp1 ;;
    tp2) throughput tp2 --tensor-parallel-size 2 ;;
  esac
done
step latency-tp1 60 python -m rooflm bench latency $MODEL --batch-size 1 --input-len 128 --output-len 256 \
  --num-iters 3 --num-iters-warmup 1 --disable-tqdm --enforce-eager --output-json "$LOGS/latency-tp1.json"
step latency-pp2 60 python -m rooflm bench latency $MODEL --pipeline-parallel-size 2 --batch-size 1 \
  --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --disable-tqdm \
  --output-json "$LOGS/latency-pp2.json"

python - "$OUT" "$N" <<'PY' 2>&1 | tee -a "$SUMMARY"
import json, os, sys
out, n = sys.argv[1], sys.argv[2]
def get(name, *keys):
    try:
        value = json.load(open(os.path.join(out, "logs", name)))
        for k in keys:
            value = value[k]
        return value
    except (OSError, KeyError, TypeError, ValueError):
        return None
fmt = lambda v, spec=",.1f": "-" if v is None else format(v, spec)
runs = ["tp1", "tp1-eager", "pp2-sync", "pp2", "tp2-eager", "tp2"]
thr = {k: get(f"throughput-{k}.json", "output_tokens_per_s") for k in runs}
base = thr["tp1-eager"]
print()
print(f"offline {n} x 1024/1024, output tok/s (x TP=1 eager):")
print("| " + " | ".join(runs) + " |")
print("| " + " | ".join("---:" for _ in runs) + " |")
print("| " + " | ".join(fmt(thr[k]) + ("" if not (thr[k] and base) else f" ({thr[k] / base:.2f}x)") for k in runs) + " |")
lat = {k: get(f"latency-{k}.json", "tpot_ms", "median") for k in ("tp1", "pp2")}
print(f"batch-1 TPOT, ms: TP=1 eager {fmt(lat['tp1'], '.2f')}, PP=2 {fmt(lat['pp2'], '.2f')}")
json.dump({"throughput_tok_s": thr, "tpot_ms": lat, "num_prompts": int(n)}, open(os.path.join(out, "results.json"), "w"), indent=1)
PY
say "GPU tests: $(grep -hE "token-for-token|shutdown took" "$LOGS/gpu-tests.txt" 2>/dev/null | tr '\n' ';') $(tail -1 "$LOGS/gpu-tests.txt" 2>/dev/null)"
say "total ${SECONDS} s"
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
