#!/usr/bin/env bash
# The 16k prefill profile with Triton and FA4 prefill, alternated, with the SM clock and
# power sampled (nvidia-smi dmon) beside it: are the GEMMs slower in the FA4 run because of clocks?
# Usage (GPU machine, after fa4_setup.sh's wheels): bash benchmarks/fa4_clocks.sh DIR
set -uo pipefail
source "$(dirname "$0")/fa4_setup.sh" > /dev/null
mkdir -p "$1"
for pa in triton auto triton auto; do
  nvidia-smi dmon -s pc -d 1 > "$1/dmon-$pa-$$-$RANDOM.txt" 2>&1 &
  dmon=$!
  python3 benchmarks/prefill_profile.py --input-len 16000 --prefill-attention $pa 2>&1 | grep -v -i "warn\|exe_args" \
    | sed -n '1,6p' | tee -a "$1/profile.txt"
  kill $dmon
done
