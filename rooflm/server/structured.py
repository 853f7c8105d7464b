"""A request's structured-output fields -> one checked constraint for the engine.

Accepted (one at a time; two are a 400 naming the second):
  response_format   OpenAI: {"type": "text"}, {"type": "json_object"},
                    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
  structured_outputs  vLLM: {"json": ...} | {"regex": ...} | {"choice": [...]} |
                    {"grammar": ...} | {"json_object": true}
  guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older fields
  tool_choice       "required" or a named function (server/tools.py builds the schema)
The grammar is built in a worker thread (a large schema takes milliseconds); an error is a
400 whose param is the field the client sent. The engine compiles it against the vocabulary
(rooflm/structured/compiler.py). strict is accepted and always honoured: the output follows
the schema whatever strict says.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from rooflm.errors import InvalidRequest
from rooflm.sampling_params import StructuredOutputsParams
from rooflm.server import protocol as p

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _from_response_format(fmt: dict[str, Any]) -> Optional[StructuredOutputsParams]:
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise p.RequestError("response_format.json_schema must be an object with a schema",
                                 param="response_format")
        schema = spec.get("schema", {"type": "object"})  # OpenAI: schema is optional
        if not isinstance(schema, dict):
            raise p.RequestError("response_format.json_schema.schema must be a JSON schema object",
                                 param="response_format")
        if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
            raise p.RequestError("response_format.json_schema.strict must be a boolean",
                                 param="response_format")
        return StructuredOutputsParams(json=schema, param="response_format")
    raise p.RequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                         f"got {p.short_repr(kind)}", param="response_format")


def _from_structured_outputs(spec: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(spec) - set(_STRUCTURED_KEYS) - {"disable_any_whitespace",
                                                          "disable_additional_properties",
                                                          "whitespace_pattern"})
    if unknown:
        raise p.RequestError(f"structured_outputs has unsupported keys {unknown}; use one of "
                             f"{', '.join(_STRUCTURED_KEYS)}", param="structured_outputs")
    given = {k: v for k, v in spec.items() if k in _STRUCTURED_KEYS and v not in (None, False)}
    return StructuredOutputsParams(**given, param="structured_outputs")


def resolve_constraint(request: p.SamplingRequest,
                       tool_constraint: Optional[StructuredOutputsParams] = None
                       ) -> Optional[StructuredOutputsParams]:
    """The one constraint a request asks for, or None. Raises RequestError naming the field."""
    found: list[StructuredOutputsParams] = []
    try:
        if request.response_format is not None:
            spec = _from_response_format(request.response_format)
            if spec is not None:
                found.append(spec)
        if request.structured_outputs is not None:
            found.append(_from_structured_outputs(request.structured_outputs))
        if request.guided_json is not None:
            found.append(StructuredOutputsParams(json=request.guided_json, param="guided_json"))
        if request.guided_regex is not None:
            found.append(StructuredOutputsParams(regex=request.guided_regex, param="guided_regex"))
        if request.guided_choice is not None:
            found.append(StructuredOutputsParams(choice=request.guided_choice, param="guided_choice"))
        if request.guided_grammar is not None:
            found.append(StructuredOutputsParams(grammar=request.guided_grammar,
                                                 param="guided_grammar"))
    except InvalidRequest as exc:
        raise p.RequestError(str(exc), param=exc.param) from None
    if tool_constraint is not None:
        found.append(tool_constraint)
    if len(found) > 1:
        raise p.RequestError(f"{found[1].param} cannot be combined with {found[0].param}: a "
                             "request takes one output constraint", param=found[1].param)
    return found[0] if found else None


async def prepare_constraint(request: p.SamplingRequest,
                             tool_constraint: Optional[StructuredOutputsParams] = None) -> None:
    """Resolve and check the request's constraint, and hand it to its sampling_params."""
    constraint = resolve_constraint(request, tool_constraint)
    if constraint is not None:
        from rooflm.structured.grammars import check_structured_outputs
        try:
            await asyncio.to_thread(check_structured_outputs, constraint)
        except InvalidRequest as exc:
            raise p.RequestError(str(exc), param=exc.param) from None
    request.set_constraint(constraint)
