#!/usr/bin/env bash
# Where TP=2's offline time goes, on 2 GPUs of one host, one call of ~5 minutes:
#   1. offline 400 x 1024/1024 with --breakdown (time per step kind: decode graph / mixed / prefill,
#      host vs device), TP=1 on GPU 0 while the GGUF-on-CUDA GPU tests run on GPU 1 (they need
#      gguf-py: carry .whl from benchmarks/fetch_serving_wheels.sh);
#   2. the same with TP=2 (--tp-allreduce auto);
#   3. `rooflm profile` of TP=2 prefill-phase steps (warm-up 40 steps: 400 prompts are still
#      arriving, ~80 sequences decode beside each 2048-token chunk), then the same at TP=1;
#   4. tests/distributed/test_tp_gpu.py -k qwen2 (the case tp.sh's step limit cut on 11-25).
# OLD=dir (a copy of another commit's rooflm/ package, e.g. `git archive C rooflm | tar -x -C dir`,
# carried) adds an A/B of the host path in the same call: TP=2 offline with OLD's code, and the
# ShareGPT-like offline workload (1000 x ~230/~200) on one GPU, this tree on GPU 0 beside OLD's on GPU 1.
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/tp_offline.sh   ($OUT ends with summary.md and logs.tar.gz)
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN ROOFLM_TP_STEP_TIMES=1
OUT=${OUT:-benchmarks/results/tp-offline}
LOGS="$OUT/logs"; mkdir -p "$LOGS"
MODEL=${MODEL:-"--model llama-3-8b --load-format dummy --max-model-len 2048"}
N=${LONG_PROMPTS:-400}
SUMMARY="$OUT/summary.md"
BUDGET_S=${BUDGET_S:-450}
# Knobs: GPU1_TESTS (pytest paths run on GPU 1 beside TP=1), TP_TEST_K (-k of the TP parity test),
# PROFILES=0 (skip the three profiles).
GPU1_TESTS=${GPU1_TESTS:-"tests/kernels/test_gguf_on_cuda_kernels.py tests/unit/test_gguf_formats.py"}
TP_TEST_K=${TP_TEST_K:-qwen2}
PROFILES=${PROFILES:-1}  # every step's timeout is cut to what is left of it, so the tarball gets made
lim() { local left=$(( BUDGET_S - SECONDS )); (( left < 20 )) && left=1; echo $(( $1 < left ? $1 : left )); }
{ echo "# benchmarks/tp_offline.sh, $(date -u +%FT%TZ), commit ${ROOFLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tr '\n' ';'; echo; } | tee "$SUMMARY"

throughput() {  # tp, gpus, [tag, pythonpath]
  local tag=${3:-}
  CUDA_VISIBLE_DEVICES=$2 PYTHONPATH=${4:-$PYTHONPATH} timeout "$(lim 120)" python -m rooflm bench throughput $MODEL \
    --tensor-parallel-size "$1" --num-prompts "$N" --input-len 1024 --output-len 1024 --disable-tqdm --breakdown \
    --output-json "$LOGS/throughput-tp$1$tag.json" > "$LOGS/throughput-tp$1$tag.txt" 2>&1
  echo "- throughput TP=$1$tag: rc $? at ${SECONDS} s" | tee -a "$SUMMARY"
}
sharegpt() {  # gpu, tag, pythonpath
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$3 timeout "$(lim 100)" python -m rooflm bench throughput --model llama-3-8b \
    --load-format dummy --max-model-len 4096 --num-prompts 1000 --input-len 230 --output-len 200 --range-ratio 0.9 \
    --disable-tqdm --breakdown --output-json "$LOGS/sharegpt$2.json" > "$LOGS/sharegpt$2.txt" 2>&1
  echo "- ShareGPT-like TP=1$2: rc $? at ${SECONDS} s" | tee -a "$SUMMARY"
}
profile() {  # tp, gpus
  CUDA_VISIBLE_DEVICES=$2 timeout "$(lim 80)" python -m rooflm profile $MODEL --tensor-parallel-size "$1" --batch-size "$N" \
    --input-len 1024 --output-len 1024 --warmup-steps 40 --steps 5 --output "$LOGS/profile-prefill-tp$1" \
    > "$LOGS/profile-prefill-tp$1.txt" 2>&1
  echo "- profile prefill TP=$1: rc $? at ${SECONDS} s" | tee -a "$SUMMARY"
}
CUDA_VISIBLE_DEVICES=1 timeout "$(lim 150)" python -m pytest -q -p no:cacheprovider -rs $GPU1_TESTS \
  > "$LOGS/gguf-gpu-tests.txt" 2>&1 &
GGUF=$!
throughput 1 0
wait $GGUF; echo "- GPU tests on GPU 1 ($GPU1_TESTS): $(tail -1 "$LOGS/gguf-gpu-tests.txt")" | tee -a "$SUMMARY"
throughput 2 0,1
if [ -n "${OLD:-}" ]; then
  OLDPATH=$PWD/$OLD:${PYTHONPATH#$PWD:}
  throughput 2 0,1 -old "$OLDPATH"
  sharegpt 0 "" "$PYTHONPATH" &
  sharegpt 1 -old "$OLDPATH"
  wait
fi
timeout "$(lim 150)" python -m pytest -q -s -p no:cacheprovider -m gpu tests/distributed/test_tp_gpu.py -k "$TP_TEST_K" > "$LOGS/gpu-tests-qwen2.txt" 2>&1
echo "- TP GPU test ($TP_TEST_K): $(grep -hE 'token-for-token|shutdown took' "$LOGS/gpu-tests-qwen2.txt" | tr '\n' ';') $(tail -1 "$LOGS/gpu-tests-qwen2.txt")" | tee -a "$SUMMARY"
if [ "$PROFILES" = 1 ]; then
profile 2 0,1
[ -z "${OLD:-}" ] && profile 1 0
# Batch 1, TP=2: where the step goes beyond half the weight read (GEMV per shard, all-reduces, gaps).
CUDA_VISIBLE_DEVICES=0,1 timeout "$(lim 60)" python -m rooflm profile $MODEL --tensor-parallel-size 2 --batch-size 1 \
  --input-len 128 --output-len 512 --steps 20 --output "$LOGS/profile-b1-tp2" > "$LOGS/profile-b1-tp2.txt" 2>&1
echo "- profile batch-1 TP=2: rc $? at ${SECONDS} s" | tee -a "$SUMMARY"
fi
for name in throughput-tp1 throughput-tp2 throughput-tp2-old sharegpt sharegpt-old; do
  [ -f "$LOGS/$name.txt" ] || continue
  { echo; echo "## $name"; grep -E "Elapsed|Output token|Engine steps|Measured" "$LOGS/$name.txt"
    sed -n '/Step breakdown/,/^time:/p' "$LOGS/$name.txt"; grep -h '^tp rank 1:' "$LOGS/$name.txt"; } >> "$SUMMARY"
done
for name in profile-prefill-tp2 profile-prefill-tp1 profile-b1-tp2; do
  [ -f "$LOGS/$name.txt" ] || continue
  { echo; echo "## $name"; sed -n '/^wall time per step/,/^verdict/p' "$LOGS/$name.txt"; } >> "$SUMMARY"
done
rm -f "$LOGS"/profile-*/trace.json
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
echo "total ${SECONDS} s" >> "$SUMMARY"
