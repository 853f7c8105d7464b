#!/usr/bin/env bash
# Tensor parallelism, TP=1 against TP=2, on 2 GPUs of one host (the nvidia-h200-x2 kind), one call
# of under 9 minutes:
#   1. the link: `nvidia-smi topo -m` and torch's peer-access check (the one-shot all-reduce needs P2P);
#   2. NCCL against the symmetric-memory one-shot all-reduce, 8 KiB..64 MiB (benchmarks/allreduce.py);
#   3. the GPU tests (tests/distributed/test_tp_gpu.py: TP=2 greedy tokens == TP=1 with each
#      all-reduce, and the teardown that hung on 2026-11-23 now bounded);
#   4. batch-1 decode, Llama-3-8B shape (dummy bf16), 128 in / 256 out: TP=1, TP=2 --tp-allreduce nccl, symm;
#   5. offline N x 1024/1024 (N=${LONG_PROMPTS:-400}; the issue's 1000 needs a call of its own): TP=1,
#      TP=2 nccl, then `rooflm profile` of TP=2 decode at batch 256 (where its offline step goes),
#      then TP=2 symm and the TP=1 profile if the budget allows.
# ROOFLM_TP_STEP_TIMES=1: each worker prints, at stop, its host time per step against the time it
# waited for rank 0's packets (a worker busy for the whole step is what the GPUs wait on).
# Every step runs under `timeout`, within a total budget (BUDGET_S, 510 s): a step that would not
# fit is skipped and says so. NCCL_DEBUG=WARN; ROOFLM_HANG_DUMP_S=120 makes a rank that stalls for
# 2 minutes print its stacks into its log. $OUT ends with at most 4 files: summary.md (the
# tables), allreduce.json, results.json and logs.tar.gz (every log).
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/tp.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NCCL_DEBUG=WARN ROOFLM_HANG_DUMP_S=120 ROOFLM_TP_STEP_TIMES=1
OUT=${OUT:-benchmarks/results/tp}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
BUDGET_S=${BUDGET_S:-560}
MODEL="--model llama-3-8b --load-format dummy --max-model-len 2048"
N=${LONG_PROMPTS:-400}
SUMMARY="$OUT/summary.md"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_S CMD...: runs CMD under timeout, bounded by what is left of the budget.
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - SECONDS ))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then say "- $name: skipped (budget spent: ${SECONDS} s of $BUDGET_S)"; return 99; fi
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  local rc=$?
  local note=""
  (( rc == 124 || rc == 137 )) && note=" TIMED OUT after $limit s"
  grep -q "Timeout (0:02:00)" "$LOGS/$name.txt" && note="$note (stack dump in the log)"
  say "- $name: rc $rc, $(( SECONDS - t0 )) s$note"
  return $rc
}

say "# benchmarks/tp.sh, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)"
say ""
say "GPUs: $(nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tr '\n' ';')"
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then say "benchmarks/tp.sh needs 2 GPUs"; exit 1; fi
nvidia-smi topo -m > "$LOGS/topo.txt" 2>&1
say ""
say '```'
sed -n '1,4p' "$LOGS/topo.txt" | tee -a "$SUMMARY"
say '```'
python - <<'PY' 2>&1 | tee -a "$SUMMARY"
import torch
from rooflm.distributed.allreduce import peer_access, symm_op_available
ok, why = peer_access(2)
print(f"peer access GPU0<->GPU1: {torch.cuda.can_device_access_peer(0, 1)} / {torch.cuda.can_device_access_peer(1, 0)}; "
      f"one-shot op in torch {torch.__version__}: {symm_op_available()}; --tp-allreduce auto picks "
      f"{'symm' if ok and symm_op_available() else 'nccl'}{'' if ok else ' (' + why + ')'}")
PY
say ""
say "Steps:"
step allreduce 110 python benchmarks/allreduce.py --ranks 2 --out "$OUT"
step gpu-tests 260 python -m pytest -q -s -p no:cacheprovider -m gpu tests/distributed/test_tp_gpu.py

latency() {  # tp allreduce
  step "latency-tp$1-$2" 120 python -m rooflm bench latency $MODEL --tensor-parallel-size "$1" --tp-allreduce "$2" \
    --batch-size 1 --input-len 128 --output-len 256 --num-iters 3 --num-iters-warmup 1 --disable-tqdm \
    --output-json "$LOGS/latency-tp$1-$2.json"
}
throughput() {  # tp allreduce
  step "throughput-tp$1-$2" 110 python -m rooflm bench throughput $MODEL --tensor-parallel-size "$1" \
    --tp-allreduce "$2" --num-prompts "$N" --input-len 1024 --output-len 1024 --disable-tqdm --breakdown \
    --output-json "$LOGS/throughput-tp$1-$2.json"
}
latency 1 nccl
latency 2 nccl
latency 2 symm
profile() {  # tp
  step "profile-tp$1" 100 python -m rooflm profile $MODEL --tensor-parallel-size "$1" --batch-size 256 \
    --input-len 1024 --output-len 1024 --steps 10 --output "$LOGS/profile-tp$1"
}
throughput 1 nccl
throughput 2 nccl
profile 2
throughput 2 symm
profile 1

python - "$OUT" "$N" <<'PY' 2>&1 | tee -a "$SUMMARY"
import json, os, sys
out, n = sys.argv[1], sys.argv[2]
logs = os.path.join(out, "logs")
def get(name, *keys):
    try:
        value = json.load(open(os.path.join(logs if name != "allreduce.json" else out, name)))
        for k in keys:
            value = value[k]
        return value
    except (OSError, KeyError, TypeError, ValueError):
        return None
fmt = lambda v, spec=",.1f": "-" if v is None else format(v, spec)
ratio = lambda a, b: "-" if not (a and b) else f"{b / a:.2f}x"
lat = {k: get(f"latency-{k}.json", "output_tokens_per_s", "median") for k in ("tp1-nccl", "tp2-nccl", "tp2-symm")}
tpot = {k: get(f"latency-{k}.json", "tpot_ms", "median") for k in lat}
thr = {k: get(f"throughput-{k}.json", "output_tokens_per_s") for k in lat}
bound = get("allreduce.json", "bound_speedup")
print()
print("| what | TP=1 | TP=2 nccl | TP=2 symm | nccl / TP=1 | symm / TP=1 | target |")
print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
print(f"| batch-1 decode 128/256, tok/s | {fmt(lat['tp1-nccl'])} | {fmt(lat['tp2-nccl'])} | {fmt(lat['tp2-symm'])} "
      f"| {ratio(lat['tp1-nccl'], lat['tp2-nccl'])} | {ratio(lat['tp1-nccl'], lat['tp2-symm'])} "
      f"| >= 1.75x (bound {fmt(bound, '.2f')}x) |")
print(f"| batch-1 TPOT, ms | {fmt(tpot['tp1-nccl'], '.2f')} | {fmt(tpot['tp2-nccl'], '.2f')} | {fmt(tpot['tp2-symm'], '.2f')} | | | |")
print(f"| offline {n} x 1024/1024, output tok/s | {fmt(thr['tp1-nccl'])} | {fmt(thr['tp2-nccl'])} | {fmt(thr['tp2-symm'])} "
      f"| {ratio(thr['tp1-nccl'], thr['tp2-nccl'])} | {ratio(thr['tp1-nccl'], thr['tp2-symm'])} | >= 1.9x |")
json.dump({"latency_tok_s": lat, "tpot_ms": tpot, "throughput_tok_s": thr, "allreduce_bound": bound,
           "num_prompts": int(n)}, open(os.path.join(out, "results.json"), "w"), indent=1)
PY
# The all-reduce table and the test verdict, from their logs.
say ""
sed -n '/^all-reduce,/,/^llama-3-8b/p' "$LOGS/allreduce.txt" 2>/dev/null | tee -a "$SUMMARY" > /dev/null
say ""
say ""
say "Workers (rank 1's host time per step, ROOFLM_TP_STEP_TIMES):"
for f in "$LOGS"/latency-tp2-*.txt "$LOGS"/throughput-tp2-*.txt "$LOGS"/profile-tp2.txt; do
  [ -f "$f" ] && say "- $(basename "$f" .txt): $(grep -h '^tp rank 1:' "$f" | tail -1)"
done
for f in "$LOGS"/profile-tp*.txt; do
  [ -f "$f" ] && { say ""; say "$(basename "$f" .txt):"; sed -n '/^wall time per step/,/^summary:/p' "$f" | tee -a "$SUMMARY" > /dev/null; }
done
say "GPU tests: $(grep -hE "sequences token-for-token|shutdown took" "$LOGS/gpu-tests.txt" 2>/dev/null | tr '\n' ';') $(tail -1 "$LOGS/gpu-tests.txt" 2>/dev/null)"
say "total ${SECONDS} s"
rm -f "$LOGS"/profile-tp*/trace.json  # tens of MB each; summary.json stays
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
cat "$SUMMARY" > /dev/null
