"""scripts/setup.sh leaves the stamp scripts/test.sh checks, so set-up run alone is not repeated.

The scripts run in a scratch copy of the repository's scripts with a fake `python3` on PATH:
it records every call instead of creating a venv or installing anything."""

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Stands in for python3 and, copied into .venv/bin, for the venv's python: logs each call.
FAKE_PYTHON = textwrap.dedent("""\
    #!/usr/bin/env bash
    echo "$*" >> "$CALLS"
    if [[ "$1 $2" == "-m venv" ]]; then
        mkdir -p "$3/bin"
        echo "PATH=\\"$PWD/$3/bin:\\$PATH\\"" > "$3/bin/activate"
        cp "$0" "$3/bin/python"
    fi
""")


@pytest.fixture()
def repo(tmp_path):
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return tmp_path


def _run(repo: Path, script: str) -> tuple[str, list[str]]:
    calls = repo / "calls.log"
    calls.write_text("")
    env = dict(os.environ, PATH=f"{repo / 'fakebin'}:{os.environ['PATH']}", CALLS=str(calls))
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([script], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, calls.read_text().splitlines()


def test_setup_alone_writes_the_stamp_test_sh_accepts(repo):
    _, calls = _run(repo, "./scripts/setup.sh")
    assert "-m venv .venv" in calls and any("pip install" in c for c in calls)
    assert (repo / ".venv" / ".setup-stamp").read_text().strip()

    out, calls = _run(repo, "./scripts/test.sh")
    assert "skipping it" in out
    assert not any("pip install" in c or "venv" in c for c in calls), calls
    assert any(c.startswith("-m pytest") for c in calls), calls


def test_a_changed_pyproject_runs_setup_again(repo):
    _run(repo, "./scripts/setup.sh")
    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    out, calls = _run(repo, "./scripts/test.sh")
    assert "skipping it" not in out
    assert any("pip install" in c for c in calls), calls
    # ...and the fresh stamp makes the next run skip set-up.
    out, calls = _run(repo, "./scripts/test.sh")
    assert "skipping it" in out and not any("pip install" in c for c in calls)


def test_ci_runs_exactly_the_readme_test_command():
    lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[-1] == "./scripts/test.sh"
