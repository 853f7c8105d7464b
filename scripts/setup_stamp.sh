# Sourced by scripts/setup.sh and scripts/test.sh: the one definition of the set-up stamp.
# The stamp holds the hash of what set-up installs from (pyproject.toml and scripts/setup.sh);
# setup.sh writes it when it succeeds, test.sh re-runs set-up only when it differs.
SETUP_STAMP=.venv/.setup-stamp

setup_hash() {
    cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1
}
