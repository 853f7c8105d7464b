#!/usr/bin/env bash
# Sets up (if needed) and runs the whole CPU test suite.
# Set-up runs again only when what it installs may have changed: scripts/setup.sh leaves a stamp
# (scripts/setup_stamp.sh defines it). A clean clone has no .venv and no stamp, so it always gets
# the full set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_stamp.sh
if [[ ! -x .venv/bin/python || ! -f "$SETUP_STAMP" || "$(cat "$SETUP_STAMP")" != "$(setup_hash)" ]]; then
    ./scripts/setup.sh
else
    echo "set-up is current (pyproject.toml and scripts/setup.sh unchanged); skipping it"
fi
. .venv/bin/activate
# The suite's wall time, printed last whatever the outcome (target: under 15 min on 2 quiet cores).
started=$SECONDS
rc=0
# --durations=25: every CI log names the slowest tests, so a test that grows shows up where it lands.
# Two pytest-xdist workers, a file's tests on one of them (module-scoped servers and models are
# built once): run alone, the suite kept one of CI's two cores busy on average (29 min of CPU in
# 29 min). TEST_WORKERS=0 runs it in this process; tests marked `exclusive` run with nothing beside
# them (tests/conftest.py).
python -m pytest -q -p no:cacheprovider --durations=25 -n "${TEST_WORKERS:-2}" --dist loadfile "$@" || rc=$?
elapsed=$((SECONDS - started))
printf 'test suite wall time: %dm %02ds (pytest exit code %d)\n' $((elapsed / 60)) $((elapsed % 60)) "$rc"
exit "$rc"
