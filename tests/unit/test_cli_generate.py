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
