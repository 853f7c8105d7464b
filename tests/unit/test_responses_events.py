"""The /v1/responses event stream with tools, without a server: a fake generation replays a reply
in pieces through ResponseHandler.events, and the events are read as the openai client reads them.
(The server tests cover required and named tool_choice on SmolLM2; this one covers "auto", where
text comes before a call, which a 135M model cannot be made to write reliably.)"""

import asyncio
import json
from types import SimpleNamespace

import pytest

from rooflm.engine.outputs import CompletionOutput, RequestOutput
from rooflm.server import protocol as p
from rooflm.server import responses_protocol as rp
from rooflm.server.responses import ResponseHandler
from rooflm.server.tools import ToolCalling

TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
REPLY = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '</tool_call><tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


class FakeGeneration:
    """A generation whose outputs are a fixed reply, a few characters per step."""

    def __init__(self, text: str, piece: int, finish_reason: str = "stop"):
        self.text, self.piece, self.finish_reason = text, piece, finish_reason

    async def outputs(self):
        for start in range(0, len(self.text), self.piece):
            end = min(start + self.piece, len(self.text))
            finish = self.finish_reason if end == len(self.text) else None
            sample = CompletionOutput(0, self.text[:end], [], finish_reason=finish)
            yield 0, RequestOutput("r", None, [1], [sample], finish is not None,
                                   delta_text=[self.text[start:end]])

    def usage(self):
        return p.UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3)


def handler(tool_choice="auto", tools=(TOOL,)):
    request = rp.ResponsesRequest(model="m", input="Weather?", tools=list(tools) or None,
                                  tool_choice=tool_choice)
    chat = p.validate_request(p.ChatCompletionRequest, {
        "model": "m", "messages": request.messages(), "tools": request.chat_tools(),
        "tool_choice": request.chat_tool_choice()})
    state = SimpleNamespace(model_name="m")
    return ResponseHandler(state, request, "abc", ToolCalling(chat, None))


def events(h: ResponseHandler, generation) -> list[dict]:
    async def collect():
        return [chunk async for chunk in h.events(generation)]
    out = []
    for chunk in asyncio.run(collect()):
        kind, data = chunk.strip().split("\n")
        assert kind == "event: " + json.loads(data[len("data: "):])["type"]
        out.append(json.loads(data[len("data: "):]))
    return out


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_text_then_calls_as_items(piece):
    h = handler()
    got = events(h, FakeGeneration(REPLY, piece))
    kinds = [e["type"] for e in got]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    text_deltas = [e["delta"] for e in got if e["type"] == "response.output_text.delta"]
    assert "".join(text_deltas) == "Let me check."
    # Message item first (opened at the first text, closed when the first call starts), then one
    # function_call item per call, each with its arguments streamed in fragments.
    items = [(e["type"], e["output_index"], e["item"]["type"]) for e in got
             if e["type"] in ("response.output_item.added", "response.output_item.done")]
    assert items == [("response.output_item.added", 0, "message"),
                     ("response.output_item.done", 0, "message"),
                     ("response.output_item.added", 1, "function_call"),
                     ("response.output_item.done", 1, "function_call"),
                     ("response.output_item.added", 2, "function_call"),
                     ("response.output_item.done", 2, "function_call")]
    done = [e for e in got if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"city": "Paris"}', '{"city": "Rome"}']
    for e in done:
        fragments = [d["delta"] for d in got if d["type"] == "response.function_call_arguments.delta"
                     and d["item_id"] == e["item_id"]]
        assert "".join(fragments) == e["arguments"]
        assert piece > 100 or len(fragments) > 2
    assert kinds[-1] == "response.completed"
    # The final response is what the unstreamed answer would be (ids aside).
    final = got[-1]["response"]
    whole = h.response(RequestOutput("r", None, [1], [CompletionOutput(0, REPLY, [], finish_reason="stop")],
                                     True), FakeGeneration(REPLY, 1000)).model_dump()

    def shape(output):
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]
    assert shape(final["output"]) == shape(whole["output"])
    assert [o["call_id"] for o in final["output"][1:]] == [
        e["item"]["call_id"] for e in got if e["type"] == "response.output_item.done"
        and e["item"]["type"] == "function_call"]


def test_auto_without_a_call_is_one_message():
    got = events(handler(), FakeGeneration("It is sunny. a < b", 3))
    items = [(e["type"], e["item"]["type"]) for e in got if "output_item" in e["type"]]
    assert items == [("response.output_item.added", "message"), ("response.output_item.done", "message")]
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == "It is sunny. a < b"


def test_no_tools_keeps_the_plain_event_order():
    got = events(handler("none", ()), FakeGeneration("Hello there", 5, finish_reason="length"))
    kinds = [e["type"] for e in got]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]


def test_text_format_becomes_chats_response_format():
    def fmt(text):
        return rp.ResponsesRequest(model="m", input="x", text=text).chat_response_format()
    schema = {"type": "object"}
    assert fmt({"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}}) == {
        "type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}
    assert fmt({"format": {"type": "json_object"}}) == {"type": "json_object"}
    assert fmt({"format": {"type": "text"}}) is None and fmt(None) is None
