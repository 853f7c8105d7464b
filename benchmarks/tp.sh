#!/usr/bin/env bash
# Tensor parallelism, TP=1 against TP=2, on 2 GPUs of one host (the nvidia-h200-x2 kind), one call:
#   1. the GPU parity test (tests/distributed/test_tp_gpu.py: TP=2 greedy tokens == TP=1, fp32);
#   2. NCCL all-reduce time, eager and in a CUDA graph (benchmarks/allreduce.py), and the batch-1
#      bound it implies (2x less the all-reduces);
#   3. batch-1 decode, Llama-3-8B shape (dummy weights, bf16), 128 in / 256 out, TP=1 and TP=2;
#   4. offline throughput, N x 1024/1024 (N=${LONG_PROMPTS:-400}; the issue's target is 1000:
#      LONG_PROMPTS=1000, about 6 more minutes), TP=1 and TP=2.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/tp.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-benchmarks/results/tp}
mkdir -p "$OUT"
MODEL="--model llama-3-8b --load-format dummy --max-model-len 2048"
N=${LONG_PROMPTS:-400}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then echo "benchmarks/tp.sh needs 2 GPUs"; exit 1; fi
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true

timeout 240 python -m pytest -q -s -p no:cacheprovider -m gpu tests/distributed/test_tp_gpu.py > "$OUT/gpu-tests.txt" 2>&1
echo "parity test: $(grep -h "sequences token-for-token" "$OUT/gpu-tests.txt" | tr "\n" " ") $(tail -1 "$OUT/gpu-tests.txt")"
timeout 120 python benchmarks/allreduce.py --ranks 2 --out "$OUT" 2>&1 | tee "$OUT/allreduce.txt"

latency() {  # tp, extra flags
  local tp=$1; shift
  timeout 200 python -m rooflm bench latency $MODEL --tensor-parallel-size "$tp" --batch-size 1 --input-len 128 \
    --output-len 256 --num-iters 3 --num-iters-warmup 1 --disable-tqdm --output-json "$OUT/latency-tp$tp$*.json" "$@" \
    > "$OUT/latency-tp$tp$*.txt" 2>&1 || echo "latency tp$tp $*: failed (rc $?), see $OUT/latency-tp$tp$*.txt"
}
throughput() {  # tp
  timeout 300 python -m rooflm bench throughput $MODEL --tensor-parallel-size "$1" --num-prompts "$N" --input-len 1024 \
    --output-len 1024 --disable-tqdm --output-json "$OUT/throughput-tp$1.json" \
    > "$OUT/throughput-tp$1.txt" 2>&1 || echo "throughput tp$1: failed (rc $?), see $OUT/throughput-tp$1.txt"
}
latency 1
latency 2
# Without CUDA graphs too when the graphed TP=2 run failed: tells graphs from the rest.
[ -s "$OUT/latency-tp2.json" ] || latency 2 --enforce-eager
throughput 1
throughput 2

python - "$OUT" "$N" <<'PY'
import json, os, sys
out, n = sys.argv[1], sys.argv[2]
def get(name, *keys):
    try:
        value = json.load(open(os.path.join(out, name)))
        for k in keys:
            value = value[k]
        return value
    except (OSError, KeyError, TypeError, ValueError):
        return None
def fmt(v, spec=",.1f"):
    return "-" if v is None else format(v, spec)
ar = get("allreduce.json", "results")
bound = get("allreduce.json", "bound_speedup")
l1 = get("latency-tp1.json", "output_tokens_per_s", "median")
l2 = get("latency-tp2.json", "output_tokens_per_s", "median") or get("latency-tp2--enforce-eager.json", "output_tokens_per_s", "median")
t1 = get("throughput-tp1.json", "output_tokens_per_s")
t2 = get("throughput-tp2.json", "output_tokens_per_s")
ratio = lambda a, b: "-" if not (a and b) else f"{b / a:.2f}x"
print()
print("| what | TP=1 | TP=2 | TP=2 / TP=1 | target |")
print("| --- | --- | --- | --- | --- |")
print(f"| batch-1 decode, 8B shape, 128/256 (tok/s) | {fmt(l1)} | {fmt(l2)} | {ratio(l1, l2)} | >= 1.75x (bound {fmt(bound, '.2f')}x) |")
print(f"| offline {n} x 1024/1024 (output tok/s) | {fmt(t1)} | {fmt(t2)} | {ratio(t1, t2)} | >= 1.9x |")
if ar:
    print(f"| NCCL all-reduce 1 x 4096 bf16, in a graph / eager (us) | | {ar[0]['graph_us']:.1f} / {ar[0]['eager_us']:.1f} | | |")
PY
