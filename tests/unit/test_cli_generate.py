"""`rooflm generate` with a shape preset: the README's dummy-weights commands run as written."""

import re
from pathlib import Path

import pytest

from rooflm.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_dummy_commands() -> list[list[str]]:
    """The README's `rooflm generate ... --load-format dummy` lines, as argument lists."""
    lines = re.findall(r"^rooflm (generate .*--load-format dummy.*)$", README.read_text(), re.M)
    return [line.split() for line in lines]


def test_the_readme_has_dummy_generate_examples():
    assert len(readme_dummy_commands()) >= 2


@pytest.mark.parametrize("argv", readme_dummy_commands(), ids=lambda a: " ".join(a[-4:]))
def test_readme_dummy_command_runs(argv, capsys):
    assert main(argv) == 0
    ids = capsys.readouterr().out.split()
    max_tokens = int(argv[argv.index("--max-tokens") + 1])
    assert len(ids) == max_tokens and all(i.isdigit() for i in ids)  # token ids out


def test_text_prompt_without_a_tokenizer_says_what_to_pass(capsys):
    assert main(["generate", "--model", "smollm2-135m", "--load-format", "dummy", "hi"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "--tokenizer" in err and "--prompt-token-ids" in err


@pytest.mark.parametrize("ids", ["1,x", "", "1,99999999"])
def test_bad_token_ids_are_refused(ids, capsys):
    assert main(["generate", "--model", "smollm2-135m", "--load-format", "dummy",
                 "--prompt-token-ids", ids]) == 2
    assert "--prompt-token-ids" in capsys.readouterr().err


def test_generate_prints_a_one_line_summary_on_stderr(capsys):
    assert main(["generate", "--model", "smollm2-135m", "--load-format", "dummy",
                 "--random-prompt-len", "12", "--max-tokens", "4", "--ignore-eos"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 4  # the output is untouched: token ids only
    (line,) = [l for l in captured.err.splitlines() if l.startswith("rooflm generate:")]
    assert re.fullmatch(r"rooflm generate: 12 prompt tokens, 4 output tokens, TTFT \d+\.\d ms, "
                        r"\d+\.\d output tokens/s \(\d+\.\d\d s\)", line), line


def test_summary_sums_tokens_and_averages_ttft():
    from types import SimpleNamespace as NS

    from rooflm.cli import generate_summary

    outs = [NS(prompt_token_ids=[1] * 5, outputs=[NS(token_ids=[7] * 10), NS(token_ids=[7] * 6)],
               arrival_time=100.0, first_token_time=100.2),
            NS(prompt_token_ids=[1] * 3, outputs=[NS(token_ids=[7] * 4)],
               arrival_time=100.0, first_token_time=100.4)]
    assert generate_summary(outs, 2.0) == ("rooflm generate: 2 prompts, 8 prompt tokens, 20 output tokens, "
                                           "TTFT 300.0 ms, 10.0 output tokens/s (2.00 s)")
