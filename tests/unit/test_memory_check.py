"""Memory is checked before it is allocated, and presets are never silently random models."""

import pytest
import torch

from rooflm.cli import main
from rooflm.engine import memory_check
from rooflm.engine.memory_check import InsufficientMemoryError, MemoryNeed, check_fits


def test_check_fits_names_the_numbers_and_what_to_try():
    need = MemoryNeed(weights=32_000_000_000, kv_cache=2_000_000_000, activations=300_000_000, device="cpu")
    with pytest.raises(InsufficientMemoryError) as err:
        check_fits(need, 18_000_000_000, "llama-3-8b", torch.float32)
    message = str(err.value)
    assert "llama-3-8b needs 34.3 GB of RAM" in message
    assert "weights 32.0 GB, KV cache 2.0 GB, activations 0.3 GB" in message
    assert "18.0 GB available; try --load-format dummy with --dtype bfloat16" in message
    check_fits(need, 35_000_000_000, "llama-3-8b", torch.float32)  # fits: no error
    check_fits(need, None, "llama-3-8b", torch.float32)  # unknown: not checked


def test_the_cpu_reports_available_memory():
    available = memory_check.available_bytes(torch.device("cpu"))
    assert available is None or available > 0


def test_a_load_that_cannot_fit_is_refused_before_allocating(monkeypatch):
    from rooflm import LLM

    allocated = []
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 100_000_000)
    monkeypatch.setattr("rooflm.engine.model_runner.ModelRunner.load_model",
                        lambda *a, **k: allocated.append(True))
    with pytest.raises(InsufficientMemoryError, match=r"smollm2-135m needs .* GB of RAM .* 0\.1 GB available"):
        LLM(model="smollm2-135m", load_format="dummy", device="cpu")
    assert not allocated


def test_cli_preset_without_dummy_is_an_error_not_a_random_model(capsys):
    assert main(["generate", "--model", "llama-3-8b", "hi"]) == 2
    err = capsys.readouterr().err
    assert "llama-3-8b is a shape preset: pass --load-format dummy, or a model path" in err


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("rooflm 0.")


def test_serve_takes_the_model_positionally_and_refuses_two(capsys):
    from rooflm.cli import build_parser
    args = build_parser().parse_args(["serve", "x.gguf"])
    assert args.model_tag == "x.gguf" and args.model is None
    args = build_parser().parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    assert args.func(args) == 2
    assert "two models given: 'a.gguf' and --model 'b.gguf'" in capsys.readouterr().err
