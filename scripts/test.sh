#!/usr/bin/env bash
# Sets up (if needed) and runs the whole CPU test suite.
# Set-up runs again only when what it installs may have changed: the stamp holds the hash of
# pyproject.toml and scripts/setup.sh from the last set-up that succeeded. A clean clone has no
# .venv and no stamp, so it always gets the full set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ ! -x .venv/bin/python || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    ./scripts/setup.sh
    echo "$want" > "$stamp"
else
    echo "set-up is current (pyproject.toml and scripts/setup.sh unchanged); skipping it"
fi
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider "$@"
