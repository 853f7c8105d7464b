"""The CLI fails fast: no prefix matching of flags, a "did you mean" for a typo, and --version,
--help and a typo answered without importing torch or the engine."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rooflm.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "rooflm.engine", "rooflm.llm", "rooflm.model", "rooflm.layers", "rooflm.server.app")

# Runs the CLI in a fresh interpreter, then reports which heavy modules that run imported.
PROBE = f"""
import sys
from rooflm.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print("HEAVY", [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)
sys.exit(code)
"""


def _probe(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_no_parser_takes_abbreviations():
    parsers = list(_all_parsers(build_parser()))
    assert len(parsers) > 10
    assert [p.prog for p in parsers if p.allow_abbrev] == []


def test_a_prefix_of_a_flag_is_an_error_not_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "--max-token", "5", "hi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-token" in err and "did you mean --max-tokens" in err


@pytest.mark.parametrize("argv, words", [
    (["generat", "hi"], ["invalid choice: 'generat'", "did you mean 'generate'"]),
    (["generate", "--max-token", "5", "hi"], ["rooflm generate: error", "did you mean --max-tokens"]),
    (["bench", "latency", "--num-iter", "3"], ["rooflm bench latency: error", "did you mean --num-iters"]),
    (["--verison"], ["did you mean --version"]),
])
def test_a_typo_exits_2_with_a_suggestion_and_without_torch(argv, words):
    proc = _probe(*argv)
    assert proc.returncode == 2, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert "HEAVY []" in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["serve", "--help"], ["bench", "latency", "--help"]])
def test_version_and_help_do_not_import_torch_or_the_engine(argv):
    proc = _probe(*argv)
    assert proc.returncode == 0, proc.stderr
    assert ("rooflm " in proc.stdout) if argv == ["--version"] else ("usage: rooflm" in proc.stdout)
    assert "HEAVY []" in proc.stderr, proc.stderr
