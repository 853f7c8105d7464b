"""Tool-call parsers per template family, whole and streamed in pieces of every size, and the
schemas that enforce tool_choice "required" and a named function."""

import json

import jsonschema
import pytest

from rooflm.server.tool_choice import parse_named, parse_required, required_schema
from rooflm.server.tool_parsers import (CallScanner, HermesToolParser, JsonArrayToolParser,
                                  Llama3JsonToolParser, parser_for_template)

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"zone": "CET"}}]'
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def assemble(deltas):
    """Calls joined from streamed deltas, as an SDK user joins them: (id, name, arguments)."""
    calls = {}
    for d in deltas:
        if d.id is not None:
            assert d.index not in calls  # one first delta per call
            calls[d.index] = [d.id, d.name, ""]
        calls[d.index][2] += d.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def as_pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_whole():
    content, calls = HermesToolParser().parse(HERMES)
    assert content == "Let me check." and as_pairs(calls) == CALLS
    assert len({c.id for c in calls}) == 2


def test_llama3_json_whole():
    content, calls = Llama3JsonToolParser().parse(LLAMA)
    assert content is None and as_pairs(calls) == CALLS
    assert as_pairs(Llama3JsonToolParser().parse('{"name": "f", "parameters": {}}')[1]) == [("f", {})]


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser()])
@pytest.mark.parametrize("text", ["The weather is fine.", "<tool_call>\n{not json}\n</tool_call>",
                                  '{"no_name": 1}', "", "a < b and {braces}"])
def test_text_that_is_not_a_call_stays_content(parser, text):
    content, calls = parser.parse(text)
    assert calls == [] and content == text
    stream = parser.stream()
    pieces = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(c for c, _ in pieces) == text and not any(calls for _, calls in pieces)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("parser,text", [(HermesToolParser(), HERMES), (Llama3JsonToolParser(), LLAMA),
                                         (JsonArrayToolParser(), REQUIRED)])
def test_streamed_in_pieces_equals_whole(parser, text, size):
    stream = parser.stream()
    content, deltas = "", []
    for start in range(0, len(text), size):
        c, new = stream.feed(text[start:start + size])
        content, deltas = content + c, deltas + new
    c, new = stream.finish()
    content, deltas = content + c, deltas + new
    whole_content, whole_calls = parser.parse(text)
    assert content.strip() == (whole_content or "")
    # The arguments are the model's own text, the same whole or streamed, and valid JSON.
    assert [(name, args) for _, name, args in assemble(deltas)] == [
        (c.name, c.arguments) for c in whole_calls]
    assert as_pairs(whole_calls) == CALLS
    if size < 5:  # small pieces: each call's arguments came in several fragments
        for index in range(2):
            assert sum(1 for d in deltas if d.index == index and d.arguments) > 3


def test_a_call_streams_its_name_first_then_argument_fragments():
    stream = HermesToolParser().stream()
    content, deltas = stream.feed('Sure.<tool_call>\n{"name": "get_weather", "argu')
    assert content == "Sure." and len(deltas) == 1
    assert deltas[0].name == "get_weather" and deltas[0].id.startswith("call_") and deltas[0].arguments == ""
    _, deltas = stream.feed('ments": {"city": "Pa')
    assert [(d.id, d.arguments) for d in deltas] == [(None, '{"city": "Pa')]
    _, deltas = stream.feed('ris"}}\n</tool_call>')
    assert [d.arguments for d in deltas] == ['ris"}']


def test_hermes_stream_finishes_a_call_at_its_closing_tag():
    stream = HermesToolParser().stream()
    first = HERMES[:HERMES.index("</tool_call>") + len("</tool_call>")]
    content, deltas = stream.feed(first)
    assert content == "Let me check.\n"
    assert [(n, json.loads(a)) for _, n, a in assemble(deltas)] == CALLS[:1]


def test_call_objects_in_other_shapes():
    # Arguments written as a JSON string (some models do), keys in either order, nested values.
    content, calls = HermesToolParser().parse(
        '<tool_call>{"arguments": "{\\"x\\": [1, {\\"y\\": \\"}\\"}]}", "name": "f"}</tool_call>')
    assert as_pairs(calls) == [("f", {"x": [1, {"y": "}"}]})]
    _, calls = Llama3JsonToolParser().parse('{"name": "g", "parameters": {"a": {"b": [true, null, 2.5]}}}')
    assert calls[0].arguments == '{"a": {"b": [true, null, 2.5]}}'
    _, calls = Llama3JsonToolParser().parse('{"name": "h"}')  # no arguments: an empty object
    assert as_pairs(calls) == [("h", {})]
    scanner = CallScanner()
    assert scanner.feed('{"name": "f", "arguments": {}} tail') == " tail" and scanner.done


def test_parser_follows_the_template_family():
    assert isinstance(parser_for_template("{{ '<|python_tag|>' }}"), Llama3JsonToolParser)
    assert isinstance(parser_for_template("{% if tools %}<tool_call>{% endif %}"), HermesToolParser)
    assert isinstance(parser_for_template(None), HermesToolParser)


def test_required_schema_accepts_only_known_tools():
    functions = [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                                              "required": ["x"]}}, {"name": "g"}]
    schema = required_schema(functions, parallel_tool_calls=False)
    jsonschema.validate([{"name": "f", "parameters": {"x": 1}}], schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"x": "1"}}],
                [{"name": "g", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate([{"name": "g", "parameters": {}}] * 2, required_schema(functions, True))
    assert as_pairs(parse_required('[{"name": "f", "parameters": {"x": 1}}]')) == [("f", {"x": 1})]
    assert parse_required('[{"name": "f", "param') == []
    assert parse_named("f", '{"x": 1}').arguments == '{"x": 1}' and parse_named("f", "{") is None
