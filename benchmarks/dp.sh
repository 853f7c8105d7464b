#!/usr/bin/env bash
# Data parallelism, DP=1 against DP=2 on 2 GPUs of one host (the nvidia-h200-x2 kind),
# Llama-3-8B shape, bf16, dummy weights, one call (~8 min):
#   0. the GPU test (tests/distributed/test_dp_gpu.py): each replica on its own GPU, greedy parity;
#   1. offline, the ShareGPT-like workload (1000 x ~230 in / ~200 out, +-90%): DP=1 and DP=2
#      (`rooflm bench throughput --data-parallel-size 2`: two engines, every other request);
#   2. `rooflm serve --data-parallel-size 2 --dp-routing cache_aware`: the same 1000 requests all
#      at once (served DP=2), then a shared-system-prompt workload at a Poisson rate;
#   3. the same server with --dp-routing round_robin: the shared-prompt workload again;
#   4. `rooflm serve` DP=1: the 1000 requests all at once (served DP=1), if time is left
#      (PART=serve-dp1 runs only this part).
# Shared-prompt workload: 32 system prompts of 2048 tokens, each request one of them plus 64 own
# tokens, 64 out, 480 requests at 16/s. Every replica's KV pool is sized from the workload so that
# the prompts are ~1.6x what one replica holds (PREFIX_OVER): a replica keeps about 60% of them, so
# round-robin, which sends every prompt to both replicas, must evict and recompute, while
# cache-aware keeps each prompt on one replica and both pools hold the whole set. (An earlier
# 4000-block pool of 64-token blocks held all 32 x 2048 tokens 4x over: round-robin never evicted
# and the run could not tell the routers apart.) least_loaded is the third row.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/dp.sh     (PART=offline|serve|serve-dp1|all)
# Carry .whl/ (benchmarks/fetch_serving_wheels.sh): the GPU machine has no server stack.
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-benchmarks/results/dp}
PART=${PART:-all}
PORT=${PORT:-8124}
URL=http://127.0.0.1:$PORT
# Offline: the preset (token ids). Served: MODEL_DIR, an HF directory with config.json and tokenizer
# files and no weights (benchmarks/make_dummy_model_dir.py; carry it, as for serving.sh), so the
# server streams text token by token and TTFT is measured per request.
# MODEL/SERVE_MODEL/WORKLOAD/PREFIX and SMOKE=1 (no GPU check) let the script be tried on a CPU.
MODEL=${MODEL:-"--model llama-3-8b --load-format dummy --max-model-len 4096"}
MODEL_DIR=${MODEL_DIR:-benchmarks/models/llama-3-8b-dummy}
[ -n "${SERVE_MODEL:-}" ] || [ -f "$MODEL_DIR/config.json" ] \
  || python3 benchmarks/make_dummy_model_dir.py --preset llama-3-8b --out "$MODEL_DIR"
SERVE_MODEL=${SERVE_MODEL:-"--model $MODEL_DIR --load-format dummy --max-model-len 4096"}
NAME=$(basename "$MODEL_DIR")
VOCAB=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$MODEL_DIR/config.json" 2>/dev/null || echo 32000)
WORKLOAD=${WORKLOAD:-"--num-prompts 1000 --input-len 230 --output-len 200 --range-ratio 0.9"}
NUM_PREFIXES=${NUM_PREFIXES:-32}
PREFIX_LEN=${PREFIX_LEN:-2048}
PREFIX=${PREFIX:-"--dataset-name prefix --num-prefixes $NUM_PREFIXES --prefix-len $PREFIX_LEN --input-len 64 --output-len 64 --num-prompts 480 --request-rate 16"}
BLOCK_SIZE=${BLOCK_SIZE:-64}  # the engine's KV block on CUDA (rooflm serve --block-size)
PREFIX_OVER=${PREFIX_OVER:-1.6}
# Running sequences share their prompt's cached blocks and need blocks only for their own 64 + 64
# tokens (and a partial one): ~16 in flight per replica at this rate (16/s, ~1 s each).
HEADROOM_BLOCKS=${HEADROOM_BLOCKS:-$(( 16 * ((128 + BLOCK_SIZE - 1) / BLOCK_SIZE + 1) ))}
PREFIX_BLOCKS=${PREFIX_BLOCKS:-$(python3 -c "import math,sys; n,l,b,o,h=map(float,sys.argv[1:]); print(int(math.ceil(n*l/b/o)+h))" \
  "$NUM_PREFIXES" "$PREFIX_LEN" "$BLOCK_SIZE" "$PREFIX_OVER" "$HEADROOM_BLOCKS")}
mkdir -p "$OUT"
{ date -Is; git rev-parse --short HEAD 2>/dev/null
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null; } | tee "$OUT/env.txt"
if [ -z "${SMOKE:-}" ] && [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then echo "benchmarks/dp.sh needs 2 GPUs"; exit 1; fi

offline() {  # dp
  timeout 300 python3 -m rooflm bench throughput $MODEL $WORKLOAD --data-parallel-size "$1" --disable-tqdm \
    --output-json "$OUT/offline-dp$1.json" > "$OUT/offline-dp$1.txt" 2>&1 \
    || echo "offline dp$1: failed (rc $?), see $OUT/offline-dp$1.txt"
}

SERVER_PID=
start_server() {  # tag, flags...
  local tag=$1; shift
  python3 -m rooflm --log-level INFO serve $SERVE_MODEL --served-model-name "$NAME" --max-queued-requests 2000 --log-interval 0 \
    --disable-log-requests --host 127.0.0.1 --port "$PORT" "$@" > "$OUT/server-$tag.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 300); do
    curl -sf "$URL/ready" > /dev/null && return 0
    kill -0 $SERVER_PID 2>/dev/null || { echo "server $tag exited:"; tail -20 "$OUT/server-$tag.log"; return 1; }
    sleep 1
  done
  echo "server $tag not ready"; tail -20 "$OUT/server-$tag.log"; return 1
}
stop_server() {
  [ -n "$SERVER_PID" ] && kill -TERM $SERVER_PID 2>/dev/null && wait $SERVER_PID 2>/dev/null
  SERVER_PID=
}
trap stop_server EXIT
BENCH="python3 -m rooflm bench serve --base-url $URL --model $NAME --vocab-size $VOCAB --ignore-eos \
  --request-timeout 600 --disable-tqdm"
serve() {  # tag, bench flags...  (result JSON and the per-replica /metrics after it)
  local tag=$1; shift
  timeout 240 $BENCH "$@" --result-file "$OUT/serve-$tag.json" > "$OUT/serve-$tag.txt" 2>&1 \
    || echo "serve $tag: failed (rc $?), see $OUT/serve-$tag.txt"
  curl -sf "$URL/metrics" | grep -E '^vllm:(prefix_cache_(hits|queries)|request_success)_total' \
    > "$OUT/metrics-$tag.txt"
}

if [ "$PART" = all ] || [ "$PART" = offline ]; then
  timeout 180 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/distributed/test_dp_gpu.py \
    > "$OUT/gpu-tests.txt" 2>&1
  echo "GPU test (2 replicas on 2 GPUs, greedy tokens == one engine's): $(tail -1 "$OUT/gpu-tests.txt")"
  offline 1
  offline 2
fi
if [ "$PART" = all ] || [ "$PART" = serve ]; then
  if start_server dp2-cache --data-parallel-size 2 --dp-routing cache_aware; then
    serve dp2-all-at-once $WORKLOAD --request-rate inf
    stop_server
  fi
  # A fresh server per policy, with the KV pool cut so the prompts compete for it.
  if start_server dp2-cache-prefix --data-parallel-size 2 --dp-routing cache_aware --num-blocks "$PREFIX_BLOCKS"; then
    serve prefix-cache_aware $PREFIX --seed 7
    stop_server
  fi
  if start_server dp2-rr-prefix --data-parallel-size 2 --dp-routing round_robin --num-blocks "$PREFIX_BLOCKS"; then
    serve prefix-round_robin $PREFIX --seed 7
    stop_server
  fi
  if start_server dp2-ll-prefix --data-parallel-size 2 --dp-routing least_loaded --num-blocks "$PREFIX_BLOCKS"; then
    serve prefix-least_loaded $PREFIX --seed 7
    stop_server
  fi
fi
if [ "$PART" = serve-dp1 ] || { [ "$PART" = all ] && [ "$SECONDS" -lt 380 ]; }; then
  if start_server dp1 --data-parallel-size 1; then
    serve dp1-all-at-once $WORKLOAD --request-rate inf
    stop_server
  fi
elif [ "$PART" = all ]; then
  echo "served DP=1 skipped after ${SECONDS}s: rerun with PART=serve-dp1"
fi

PREFIX_BLOCKS=$PREFIX_BLOCKS python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
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
def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}x"
o1, o2 = get("offline-dp1.json", "output_tokens_per_s"), get("offline-dp2.json", "output_tokens_per_s")
s1, s2 = get("serve-dp1-all-at-once.json", "output_throughput"), get("serve-dp2-all-at-once.json", "output_throughput")
print("| workload (Llama-3-8B shape, bf16) | DP=1 out tok/s | DP=2 out tok/s | DP=2/DP=1 (target >= 1.9x) |")
print("| --- | --- | --- | --- |")
print(f"| offline 1000 x ~230/~200 | {fmt(o1)} | {fmt(o2)} | {ratio(o2, o1)} |")
print(f"| served, same 1000 all at once | {fmt(s1)} | {fmt(s2)} | {ratio(s2, s1)} |")
def hits(tag):
    total = {}
    try:
        for line in open(os.path.join(out, f"metrics-{tag}.txt")):
            name, value = line.rsplit(" ", 1)
            if name.startswith("vllm:prefix_cache_hits_total"):
                engine = name.split('engine="')[1].split('"')[0]
                total[engine] = total.get(engine, 0) + float(value)
    except OSError:
        return "-"
    return " / ".join(f"{int(total[e]):,}" for e in sorted(total))
print()
blocks = os.environ.get("PREFIX_BLOCKS", "?")
print(f"| shared system prompts, 480 req at 16/s, 2 replicas of {blocks} blocks | TTFT mean ms | median | p99 | "
      "out tok/s | prefix-hit tokens per replica |")
print("| --- | --- | --- | --- | --- | --- |")
medians = {}
for policy in ("cache_aware", "round_robin", "least_loaded"):
    name = f"serve-prefix-{policy}.json"
    ttft = get(name, "ttft_ms") or {}
    print(f"| {policy} | {fmt(ttft.get('mean'))} | {fmt(ttft.get('median'))} | {fmt(ttft.get('p99'))} | "
          f"{fmt(get(name, 'output_throughput'))} | {hits('prefix-' + policy)} |")
    medians[policy] = ttft.get("median")
print(f"cache-aware median TTFT / round-robin's: {ratio(medians['cache_aware'], medians['round_robin'])} "
      f"(target <= 0.5x)")
for name in sorted(os.listdir(out)):
    if name.startswith("serve-") and name.endswith(".json") and get(name, "failed"):
        print(f"{name}: {get(name, 'failed')} failed requests: {get(name, 'errors')}")
PY
