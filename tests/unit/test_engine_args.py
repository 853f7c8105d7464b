"""rooflm/engine_args.py: every generated engine flag has help, closed sets list their choices."""

import argparse
import dataclasses

import pytest

from rooflm import config as cfg
from rooflm import engine_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    engine_args.add_engine_args(parser)
    return parser


def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in _parser()._actions if a.dest != "help"}


def _section_of(name: str):
    return next(cls for cls in cfg._SECTIONS.values() if name in {f.name for f in dataclasses.fields(cls)})


def test_every_engine_flag_has_help_text():
    actions = _actions()
    assert set(actions) == {f.name for f in engine_args.engine_fields()}
    for field in engine_args.engine_fields():
        text = actions[field.name].help or ""
        assert len(text.split("(default:")[0].strip()) > 10, field.name
        if field.default is None:
            assert "unset" in text, f"{field.name}: say what leaving it unset does"


def test_closed_sets_list_their_choices():
    actions = _actions()
    assert set(engine_args.CHOICES) <= set(actions)
    for name, choices in engine_args.CHOICES.items():
        assert tuple(actions[name].choices) == choices, name
        assert f"{{{','.join(choices)}}}" in _parser().format_help(), name


@pytest.mark.parametrize("name", sorted(engine_args.CHOICES))
def test_choices_are_exactly_what_the_config_accepts(name):
    """Each choice builds the config; a value outside them is refused by the config too, so the
    flag's list and the config's validation cannot drift apart."""
    section = _section_of(name)
    extra = {"draft_model": "tiny"} if section is cfg.SpeculativeConfig else {}
    for choice in engine_args.CHOICES[name]:
        section(**{name: choice, **extra})
    with pytest.raises(ValueError, match=name):
        section(**{name: "no-such-value", **extra})


def test_parsed_flags_build_the_engine_config():
    args = _parser().parse_args(["--kv-cache-dtype", "fp8", "-tp", "2", "--no-enable-prefix-caching",
                                 "--weights-seed", "3"])
    config = cfg.engine_config_from_kwargs(**engine_args.engine_kwargs(args))
    assert config.cache.kv_cache_dtype == "fp8" and config.parallel.tensor_parallel_size == 2
    assert config.cache.enable_prefix_caching is False and config.load.seed == 3
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kv-cache-dtype", "int3"])


def test_engine_args_sits_below_the_entry_point():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(engine_args))
    imported = {n.module if n.module != "rooflm" else f"rooflm.{a.name}"
                for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m and m.startswith("rooflm")} <= {"rooflm.sampling_params", "rooflm.errors",
                                                                      "rooflm.config"}
