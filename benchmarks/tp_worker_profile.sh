#!/usr/bin/env bash
# Where a TP=2 decode step's host time goes, 2 GPUs of one host, ~4 minutes:
#   1. offline 400 x 1024/1024, TP=2, rank 0 under cProfile and the worker's step loop under
#      cProfile (ROOFLM_TP_WORKER_PROFILE); prints both top lists (cProfile slows the host: read
#      the shares, not the tok/s);
#   2. `rooflm profile` (torch profiler, rank 0) of TP=2 decode steps with all 400 sequences
#      running (warm-up past the prefills);
#   3. the TP=2 = TP=1 greedy GPU test (llama).
# Usage (GPU machine, repo root): OUT=dir bash benchmarks/tp_worker_profile.sh   (carry .whl)
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN ROOFLM_TP_STEP_TIMES=1
OUT=${OUT:-benchmarks/results/tp-worker-profile}
P="$OUT/prof"; mkdir -p "$P"
MODEL="--model llama-3-8b --load-format dummy --max-model-len 2048"
ROOFLM_TP_WORKER_PROFILE=$P timeout 200 python -m cProfile -o "$P/rank0.pstats" -m rooflm bench throughput $MODEL \
  --tensor-parallel-size 2 --num-prompts 400 --input-len 1024 --output-len 1024 --disable-tqdm --breakdown \
  > "$P/throughput-tp2.txt" 2>&1
echo "throughput TP=2 under cProfile: rc $?"; grep -E "Output token|^decode|^mixed|^tp rank" "$P/throughput-tp2.txt"
python - "$P" <<'PY' > "$P/rank0.txt"
import pstats, sys
s = pstats.Stats(f"{sys.argv[1]}/rank0.pstats")
s.sort_stats("tottime").print_stats(35)
s.sort_stats("cumulative").print_stats(45)
PY
timeout 120 python -m rooflm profile $MODEL --tensor-parallel-size 2 --batch-size 400 --input-len 1024 \
  --output-len 1024 --warmup-steps 230 --steps 5 --output "$P/profile-decode-tp2" > "$P/profile-decode-tp2.txt" 2>&1
echo "profile decode TP=2: rc $?"; sed -n '/^wall time per step/,/^verdict/p' "$P/profile-decode-tp2.txt"
rm -f "$P"/profile-*/trace.json
timeout 120 python -m pytest -q -s -p no:cacheprovider -m gpu tests/distributed/test_tp_gpu.py -k llama > "$P/gpu-tests-llama.txt" 2>&1
echo "TP GPU test llama: $(grep -hE 'token-for-token' "$P/gpu-tests-llama.txt" | tr '\n' ';') $(tail -1 "$P/gpu-tests-llama.txt")"
tar -czf "$OUT/prof.tar.gz" -C "$OUT" prof && rm -rf "$P"
