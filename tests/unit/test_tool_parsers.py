"""Tool-call parsers per template family, whole and streamed in pieces of every size, and the
schemas that enforce tool_choice "required" and a named function."""

import json

import jsonschema
import pytest

from rooflm.tools.choice import parse_named, parse_required, required_schema
from rooflm.tools.parsers import (HermesToolParser, Llama3JsonToolParser, parser_for_template)

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


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
@pytest.mark.parametrize("parser,text", [(HermesToolParser(), HERMES), (Llama3JsonToolParser(), LLAMA)])
def test_streamed_in_pieces_equals_whole(parser, text, size):
    stream = parser.stream()
    content, calls = "", []
    for start in range(0, len(text), size):
        c, new = stream.feed(text[start:start + size])
        content, calls = content + c, calls + new
    c, new = stream.finish()
    content, calls = content + c, calls + new
    whole_content, whole_calls = parser.parse(text)
    assert content.strip() == (whole_content or "") and as_pairs(calls) == as_pairs(whole_calls)


def test_hermes_stream_emits_a_call_as_soon_as_it_closes():
    stream = HermesToolParser().stream()
    first = HERMES[:HERMES.index("</tool_call>") + len("</tool_call>")]
    content, calls = stream.feed(first)
    assert content == "Let me check.\n" and as_pairs(calls) == CALLS[:1]


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
