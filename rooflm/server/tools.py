"""Tool calling on chat: tools and tool_choice checked, the constraint they imply, and the
model's output read back as OpenAI tool_calls, whole or as streamed deltas.

tool_choice:
  "none"      tools are not given to the template; the reply is text (also without tools)
  "auto"      (the default with tools) the template gets the tools; the template family's
              parser (rooflm/server/tool_parsers.py) finds calls in the reply, else it is content
  "required"  the reply is a JSON array of {"name", "parameters"}, enforced by a JSON schema
  {"type": "function", "function": {"name": ...}}  the reply is that function's arguments,
              enforced by its parameters' schema
When calls come back, finish_reason is "tool_calls" and content is null (or the text before
the calls, under "auto").
"""

from __future__ import annotations

from typing import Any, Optional

from rooflm.sampling_params import StructuredOutputsParams
from rooflm.server import protocol as p
from rooflm.server.tool_choice import named_function_schema, parse_named, parse_required, required_schema
from rooflm.server.tool_parsers import (CallDelta, JsonArrayToolParser, ToolCall, ToolParser,
                                  parser_for_template)


def _functions(request: p.ChatCompletionRequest) -> list[dict[str, Any]]:
    return [tool["function"] for tool in request.tools or []]


def check_tools(request: p.ChatCompletionRequest) -> None:
    """Shapes and names of tools and tool_choice; RequestError naming the field."""
    names = set()
    for i, tool in enumerate(request.tools or []):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise p.RequestError(f"tools.{i} must be {{'type': 'function', 'function': {{...}}}}",
                                 param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise p.RequestError(f"tools.{i}.function.name is required", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise p.RequestError(f"tools.{i}.function.parameters must be a JSON schema object",
                                 param="tools")
        names.add(name)
    choice = request.tool_choice
    if choice is None or choice in ("none", "auto"):
        return
    if choice == "required":
        if not names:
            raise p.RequestError("tool_choice 'required' needs tools", param="tool_choice")
        return
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise p.RequestError("tool_choice must be 'none', 'auto', 'required' or "
                                 "{'type': 'function', 'function': {'name': ...}}",
                                 param="tool_choice")
        if name not in names:
            raise p.RequestError(f"tool_choice names function {p.short_repr(name)}, which is not "
                                 "in tools", param="tool_choice")
        return
    raise p.RequestError(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                         f"got {p.short_repr(choice)}", param="tool_choice")


class ToolCalling:
    """How one chat request's replies become tool calls."""

    def __init__(self, request: p.ChatCompletionRequest, chat_template: Optional[str]):
        choice = request.tool_choice
        self.named: Optional[dict[str, Any]] = None
        if not request.tools or choice == "none":
            self.mode = "none"
        elif choice == "required":
            self.mode = "required"
        elif isinstance(choice, dict):
            self.mode = "named"
            wanted = choice["function"]["name"]
            self.named = next(f for f in _functions(request) if f["name"] == wanted)
        else:
            self.mode = "auto"
        self.parallel = request.parallel_tool_calls is not False
        self.parser: ToolParser = parser_for_template(chat_template)
        self._functions = _functions(request)

    def constraint(self) -> Optional[StructuredOutputsParams]:
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self._functions, self.parallel),
                                           param="tool_choice")
        if self.mode == "named":
            return StructuredOutputsParams(json=named_function_schema(self.named),
                                           param="tool_choice")
        return None

    def extract(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content, calls) of a whole reply."""
        if self.mode == "none":
            return text, []
        if self.mode == "required":
            calls = parse_required(text)
            return (None, calls) if calls else (text, [])
        if self.mode == "named":
            call = parse_named(self.named["name"], text)
            return (None, [call]) if call else (text, [])
        content, calls = self.parser.parse(text)
        if not self.parallel:
            calls = calls[:1]
        return content, calls

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


def tool_calls_out(calls: list[ToolCall]) -> list[p.ToolCallOut]:
    return [p.ToolCallOut(id=c.id, function=p.FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


def _delta(delta: CallDelta, index: int) -> p.DeltaToolCall:
    if delta.id is None:
        return p.DeltaToolCall(index=index, function=p.DeltaFunctionCall(arguments=delta.arguments))
    return p.DeltaToolCall(index=index, id=delta.id, type="function",
                           function=p.DeltaFunctionCall(name=delta.name, arguments=delta.arguments))


class ToolCallStream:
    """One choice's stream: feed() each text delta and, at the end, finish(). Both return
    (content delta, tool-call deltas). A call's first delta carries its id and name as soon as
    the name is complete; its arguments follow in fragments as the model writes them, under
    every tool_choice (named: the reply is the arguments; required: the JSON array is read as
    it grows; auto: the template family's parser)."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.num_calls = 0
        mode = calling.mode
        self._parser = None
        if mode == "auto":
            self._parser = calling.parser.stream()
        elif mode == "required":
            self._parser = JsonArrayToolParser().stream()
        self._named_id: Optional[str] = None

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def _number(self, deltas: list[CallDelta]) -> list[p.DeltaToolCall]:
        if not self.calling.parallel:
            deltas = [d for d in deltas if d.index == 0]
        out = [_delta(d, d.index) for d in deltas]
        self.num_calls = max([self.num_calls] + [d.index + 1 for d in deltas])
        return out

    def feed(self, text: str) -> tuple[str, list[p.DeltaToolCall]]:
        mode = self.calling.mode
        if mode == "none" or not text:
            return text, []
        if mode == "named":
            # The reply is the arguments: stream them as they come, under one call.
            if self._named_id is None:
                self._named_id = ToolCall(self.calling.named["name"], "").id
                self.num_calls = 1
                return "", [_delta(CallDelta(0, text, self._named_id, self.calling.named["name"]), 0)]
            return "", [_delta(CallDelta(0, text), 0)]
        content, deltas = self._parser.feed(text)
        return content, self._number(deltas)

    def finish(self) -> tuple[str, list[p.DeltaToolCall]]:
        if self._parser is None:
            return "", []
        content, deltas = self._parser.finish()
        return content, self._number(deltas)
