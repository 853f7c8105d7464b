"""A request's constraint as an xgrammar Grammar, and the check that turns its errors into 400s.

The Grammar is tokenizer-independent: building it parses the schema, regex or EBNF and
finds every error a compile would, in milliseconds, without the vocabulary. The API
process runs this check in a worker thread before admission, so a bad schema is a 400
naming the field the client sent; the engine then compiles the same Grammar against
the vocabulary (compiler.py).

A grammar is EBNF (xgrammar's dialect, llama.cpp's GBNF plus repetition ranges) or Lark,
told apart as vLLM tells them: a grammar none of whose lines defines a rule with "::=" is
Lark. Lark goes through xgrammar's own Lark front end (rules and terminals, regular
expressions, `?rule`, aliases, repetition, `%import common.*`, `%ignore`), so a Lark grammar
written for vLLM works here unchanged; like vLLM, a Lark grammar without a `start` rule
starts at its first rule. Lark templates are not supported; the error says so.

JSON is generated without free whitespace (xgrammar's any_whitespace=False, with
json.dumps' separators ", " and ": "): a small model offered free whitespace can emit
newlines until max_tokens and never close the object, and the compact form is still
valid JSON for every client.
"""

from __future__ import annotations

import json
import re

from rooflm.errors import InvalidRequest
from rooflm.sampling_params import StructuredOutputsParams

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ": noise for a client.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")

JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _choice_ebnf(choices: list[str]) -> str:
    # A JSON string literal is a valid EBNF string literal in xgrammar's dialect.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Comments of either dialect, for telling them apart: EBNF's "#", Lark's "//".
_COMMENT = re.compile(r"(#|//).*$")
# A Lark rule's definition: optional ?/! modifier, a lower-case name, an optional priority.
_LARK_RULE = re.compile(r"^\s*[?!]?([a-z_][a-z0-9_]*)(?:\.-?\d+)?\s*:", re.MULTILINE)


def is_lark(grammar: str) -> bool:
    """vLLM's test: a grammar with no "::=" rule definition is Lark."""
    return not any("::=" in _COMMENT.sub("", line) for line in grammar.splitlines())


def lark_with_start(grammar: str) -> str:
    """The grammar with a `start` rule: the first rule's, when it has none (as vLLM does)."""
    names = _LARK_RULE.findall(grammar)
    if not names or "start" in names:
        return grammar
    return f"start: {names[0]}\n{grammar}"


def grammar_syntax(grammar: str) -> str:
    return "Lark" if is_lark(grammar) else "EBNF"


def build_grammar(spec: StructuredOutputsParams):
    """The xgrammar Grammar of a constraint. Raises RuntimeError (xgrammar's) on a bad one."""
    import xgrammar as xgr

    kind = spec.kind
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(spec.choice))
    if is_lark(spec.grammar):
        return xgr.Grammar.from_lark(lark_with_start(spec.grammar))
    return xgr.Grammar.from_ebnf(spec.grammar)


def error_message(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = _CPP_PREFIX.sub("", lines[0] if lines else type(exc).__name__)
    return text[:500]


def check_structured_outputs(spec: StructuredOutputsParams) -> None:
    """Raises InvalidRequest naming spec.param when the constraint cannot compile."""
    try:
        build_grammar(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        kind = spec.kind.replace('_', ' ')
        if spec.kind == "grammar":
            # Which dialect it was read as: a Lark grammar with one stray "::=" is read as EBNF.
            kind = (f"grammar (read as {grammar_syntax(spec.grammar)}: Lark unless a rule is "
                    f"defined with '::=')")
        raise InvalidRequest(f"{spec.param}: the {kind} constraint does not compile: "
                             f"{error_message(exc)}", param=spec.param) from None
