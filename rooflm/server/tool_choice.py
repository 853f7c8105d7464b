"""tool_choice "required" and a named function, as JSON schemas the output must follow.

As vLLM does: a named function's output is its arguments object alone (the schema is the
function's parameters), and "required" is a JSON array of {"name", "parameters"} objects,
one anyOf branch per tool (at most one item when parallel_tool_calls is false). The
structured-output machinery enforces the schema, so the arguments always parse and name
a tool that exists, whatever the template family.
"""

from __future__ import annotations

import json
from typing import Optional

from rooflm.server.tool_parsers import JsonArrayToolParser, ToolCall

# A function without "parameters" takes an object with any keys.
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _parameters(function: dict) -> dict:
    return function.get("parameters") or EMPTY_PARAMETERS


def named_function_schema(function: dict) -> dict:
    return _parameters(function)


def required_schema(functions: list[dict], parallel_tool_calls: bool) -> dict:
    branches = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                "parameters": _parameters(f)},
                 "required": ["name", "parameters"]} for f in functions]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a "required" output; [] when it does not parse (e.g. cut by max_tokens)."""
    return JsonArrayToolParser().parse(text)[1]


def parse_named(name: str, text: str) -> Optional[ToolCall]:
    try:
        json.loads(text)
    except ValueError:
        return None
    return ToolCall(name, text)
