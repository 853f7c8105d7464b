"""`rooflm roofline` and `rooflm memory` default --model to the embedded model, as every other
command does, and report the weight format the engine runs it in (its GGUF Q4_1 blocks)."""

import re

import pytest

from rooflm.cli import main
from rooflm.perf import commands
from rooflm.perf.commands import ResolvedModel, default_weight_format


def _weights_gb(text: str) -> float:
    return float(re.search(r"^weights\s+([\d.]+) GB", text, re.M).group(1))


def test_roofline_defaults_to_the_embedded_model_in_its_own_format(capsys):
    assert main(["roofline"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("SmolLM2-135M-Instruct.Q4_1.gguf: 0.13B params, decode")
    assert "weights q4_1 (GGUF Q4_1 blocks, 5 bits a weight" in first
    assert main(["roofline", "--dtype", "bf16"]) == 0  # the flag still overrides
    assert "weights bf16 (" in capsys.readouterr().out.splitlines()[0]


def test_memory_defaults_to_the_embedded_model_in_its_own_format(capsys):
    assert main(["memory"]) == 0
    default = capsys.readouterr().out
    assert default.startswith("SmolLM2-135M-Instruct.Q4_1.gguf: 0.13B params, weights q4_1")
    assert main(["memory", "--dtype", "bf16"]) == 0
    bf16 = capsys.readouterr().out
    # The decoder's 106M layer weights at 0.625 B instead of 2 B: well under bf16's bytes.
    assert _weights_gb(default) < 0.75 * _weights_gb(bf16)
    assert main(["memory", "--train"]) == 0  # training takes bf16, not the file's blocks
    assert "Adam, bf16 mixed precision" in capsys.readouterr().out


def test_presets_and_dequantized_gguf_formats_default_to_bf16(monkeypatch):
    assert default_weight_format(ResolvedModel("llama-3-8b", None, None)) == "bf16"
    from rooflm.model import gguf_loader

    # A Q4_K_M file is mostly Q4_K (kept in blocks); a Q6_K file is dequantized at load.
    monkeypatch.setattr(gguf_loader, "layer_weight_types", lambda path: {"Q4_K": 90, "Q6_K": 10})
    assert default_weight_format(ResolvedModel("m", None, "m.gguf")) == "q4_k"
    monkeypatch.setattr(gguf_loader, "layer_weight_types", lambda path: {"Q6_K": 90, "Q4_K": 10})
    assert default_weight_format(ResolvedModel("m", None, "m.gguf")) == "bf16"


@pytest.mark.parametrize("command", ["roofline", "memory"])
def test_a_missing_model_file_is_named(command, capsys):
    assert main([command, "--model", "no/such/model.gguf"]) == 2
    assert "no/such/model.gguf: no such file or directory" in capsys.readouterr().err


def test_resolve_model_config_still_takes_a_preset():
    assert commands.resolve_model_config("llama-3-8b").num_hidden_layers == 32
