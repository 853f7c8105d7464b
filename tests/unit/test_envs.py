"""rooflm/envs.py: the one table of ROOFLM_* switches, read through it, named in its errors."""

import pathlib
import re

import pytest

import rooflm.envs as envs
from rooflm.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2] / "rooflm"
# Names in the source that are not environment variables (a C header's include guard).
NOT_SWITCHES = {"ROOFLM_BLOCK_MATMUL_H"}


def _names_in_source() -> set[str]:
    names = set()
    for path in ROOT.rglob("*"):
        if path.suffix in (".py", ".c", ".h", ".cu", ".sh") and path.is_file():
            names |= set(re.findall(r"\bROOFLM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    return names - NOT_SWITCHES


def test_every_rooflm_name_in_the_source_is_in_the_registry():
    names = _names_in_source()
    assert len(names) >= 20, "the scan found too few names to be reading the source"
    assert names - set(envs.SWITCHES) == set()


def test_no_module_reads_a_switch_from_os_environ_itself():
    direct = re.compile(r"os\.(environ\.get|environ\[|getenv)\(?\s*[\"']ROOFLM_")
    offenders = [str(p) for p in ROOT.rglob("*.py") if p.name != "envs.py" and direct.search(p.read_text())]
    assert offenders == []


def test_every_switch_documents_itself():
    for sw in envs.SWITCHES.values():
        assert sw.name.startswith("ROOFLM_") and sw.kind and sw.doc, sw.name


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("ROOFLM_PDL", "maybe")
    with pytest.raises(envs.EnvError, match=r"ROOFLM_PDL must be 0 or 1, got 'maybe'"):
        envs.get("ROOFLM_PDL")
    monkeypatch.setenv("ROOFLM_DETERMINISTIC_MAX_SPLITS", "eight")
    with pytest.raises(ValueError, match="ROOFLM_DETERMINISTIC_MAX_SPLITS must be an integer"):
        envs.ROOFLM_DETERMINISTIC_MAX_SPLITS
    with pytest.raises(envs.EnvError, match="ROOFLM_SMALL_M_TILES must be 1, 0 or deep, got 'wide'"):
        with envs.override("ROOFLM_SMALL_M_TILES", "wide"):
            pass


def test_values_are_read_when_asked_and_typed(monkeypatch):
    monkeypatch.delenv("ROOFLM_W4_MMA_RELEASE", raising=False)
    assert envs.get("ROOFLM_W4_MMA_RELEASE") == 2
    monkeypatch.setenv("ROOFLM_W4_MMA_RELEASE", "0")
    assert envs.get("ROOFLM_W4_MMA_RELEASE") == 0
    monkeypatch.setenv("ROOFLM_TP_FAULT_INJECT", "1:3")
    assert envs.get("ROOFLM_TP_FAULT_INJECT") == (1, 3)
    monkeypatch.setenv("ROOFLM_FP8_DECODE_CONFIG", "4,1,4,2,1")
    assert envs.get("ROOFLM_FP8_DECODE_CONFIG") == (4, 1, 4, 2, 1)
    monkeypatch.setenv("ROOFLM_NATIVE_DECODE", "")  # empty: the default
    assert envs.get("ROOFLM_NATIVE_DECODE") is True


def test_override_sets_cached_switches_and_restores_them(monkeypatch):
    monkeypatch.delenv("ROOFLM_FP8_PAIRS", raising=False)
    envs.cached.forget("ROOFLM_FP8_PAIRS")
    assert envs.cached.ROOFLM_FP8_PAIRS is True
    with envs.override("ROOFLM_FP8_PAIRS", "0"):
        assert envs.cached.ROOFLM_FP8_PAIRS is False and envs.get("ROOFLM_FP8_PAIRS") is False
    assert envs.cached.ROOFLM_FP8_PAIRS is True
    with pytest.raises(KeyError, match="ROOFLM_NO_SUCH is not a rooflm environment switch"):
        envs.get("ROOFLM_NO_SUCH")


def test_rooflm_env_lists_every_switch_and_hides_secrets(monkeypatch, capsys):
    monkeypatch.setenv("ROOFLM_API_KEY", "sk-do-not-print")
    monkeypatch.setenv("ROOFLM_HANG_DUMP_S", "soon")
    monkeypatch.delenv("ROOFLM_PDL", raising=False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name in envs.SWITCHES:
        assert f"\n{name}\n" in f"\n{out}", name
    assert "sk-do-not-print" not in out and "set (hidden)" in out
    assert "ROOFLM_HANG_DUMP_S must be a number of seconds, got 'soon'" in out
    assert "ROOFLM_PDL\n    type: 0 or 1; default: 1; now: unset\n" in out
