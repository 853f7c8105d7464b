#!/usr/bin/env bash
# Sets up (if needed) and runs the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
