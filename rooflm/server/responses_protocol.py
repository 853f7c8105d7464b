"""The Responses API's request and response bodies (POST /v1/responses), the core of it.

Shapes follow the `openai` package's types (openai/types/responses/). What
rooflm serves: `input` as text or a list of messages, `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `stream`, usage, structured outputs
(`text.format` json_object / json_schema, through chat's response_format), and function
tools: `tools` ({"type": "function", "name", "parameters"}), `tool_choice`
("none", "auto", "required", {"type": "function", "name"}), `parallel_tool_calls`,
`function_call` output items, and `function_call` / `function_call_output` input
items to replay a tool conversation. What it refuses with a 400 naming the field
rather than pretending: `store: true` (nothing is stored),
`previous_response_id` (hence nothing to continue from), tools other than
functions (web search, file search, ...), `background`, and input items of other kinds (images, files, reasoning).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field

from rooflm.server import protocol as p

# Roles an input message may have; "developer" is OpenAI's newer name for system.
INPUT_ROLES = ("user", "assistant", "system", "developer")
# Content part types whose text goes into the prompt: user/system parts are input_text, earlier
# assistant turns replayed from a previous output are output_text.
TEXT_PART_TYPES = ("input_text", "output_text", "text")


class ResponsesRequest(p.OpenAIModel):
    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    background: Optional[bool] = None
    truncation: Optional[str] = None

    def check(self) -> None:
        """What this server does not do; the caller checks ranges through the chat path."""
        if self.store:
            raise p.RequestError("store: true is not supported: rooflm stores no responses; send "
                                 "store: false or leave it out", param="store")
        if self.previous_response_id is not None:
            raise p.RequestError("previous_response_id is not supported: rooflm stores no "
                                 "responses; send the whole conversation as input",
                                 param="previous_response_id")
        for i, tool in enumerate(self.tools or []):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else tool
                raise p.RequestError(f"tools.{i}: only function tools ({{'type': 'function', "
                                     f"'name': ..., 'parameters': ...}}) are supported, got "
                                     f"type {p.short_repr(kind)}", param="tools")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise p.RequestError(f"tools.{i}.name is required", param="tools")
        if self.background:
            raise p.RequestError("background: true is not supported", param="background")
        text_format = (self.text or {}).get("format")
        if text_format is not None and (not isinstance(text_format, dict) or text_format.get(
                "type") not in ("text", "json_object", "json_schema")):
            raise p.RequestError("text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                                 "{'type': 'json_schema', 'name': ..., 'schema': {...}}",
                                 param="text.format")
        if self.truncation not in (None, "disabled", "auto"):
            raise p.RequestError("truncation must be 'auto' or 'disabled'", param="truncation")
        if isinstance(self.input, str) and not self.input:
            raise p.RequestError("input must not be empty", param="input")

    def chat_response_format(self) -> Optional[dict[str, Any]]:
        """text.format as chat's response_format: the Responses API flattens json_schema's fields
        ({"type": "json_schema", "name", "schema", "strict"}); chat nests them."""
        text_format = (self.text or {}).get("format")
        if not text_format or text_format.get("type") == "text":
            return None
        if text_format["type"] == "json_object":
            return {"type": "json_object"}
        nested = {key: text_format[key] for key in ("name", "schema", "strict", "description")
                  if key in text_format}
        return {"type": "json_schema", "json_schema": nested}

    def chat_tools(self) -> Optional[list[dict[str, Any]]]:
        """The function tools in chat's nested shape; the chat path checks names and schemas."""
        if self.tools is None:
            return None
        return [{"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters") if key in tool}}
            for tool in self.tools]

    def chat_tool_choice(self) -> Optional[Union[str, dict[str, Any]]]:
        """tool_choice in chat's shape: {"type": "function", "name"} -> nested under "function"."""
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: instructions as the system turn, then input."""
        messages = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        if not self.input:
            raise p.RequestError("input must be a string or a non-empty list of messages",
                                 param="input")
        for i, item in enumerate(self.input):
            if not isinstance(item, dict):
                raise p.RequestError(f"input.{i} must be an object", param=f"input.{i}")
            kind = item.get("type", "message")
            if kind == "function_call":
                _add_function_call(messages, i, item)
            elif kind == "function_call_output":
                messages.append(_function_call_output(i, item))
            elif kind == "message":
                messages.append(_message(i, item))
            else:
                raise p.RequestError(f"input.{i}: items of type {p.short_repr(kind)} are not "
                                     f"supported; only messages, function_call and "
                                     f"function_call_output", param=f"input.{i}.type")
        return messages


def _string_field(i: int, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise p.RequestError(f"input.{i}.{key} must be a non-empty string",
                             param=f"input.{i}.{key}")
    return value


def _add_function_call(messages: list[dict[str, Any]], i: int, item: dict[str, Any]) -> None:
    """A replayed call: consecutive calls are one assistant turn with several tool_calls, as the
    chat template sees a turn that called tools in parallel."""
    call = {"id": _string_field(i, item, "call_id"), "type": "function",
            "function": {"name": _string_field(i, item, "name"),
                         "arguments": _string_field(i, item, "arguments")}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_call_output(i: int, item: dict[str, Any]) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):  # content parts; their text is the tool's answer
        if not all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in output):
            raise p.RequestError(f"input.{i}.output: only text parts are supported",
                                 param=f"input.{i}.output")
        output = "".join(part["text"] for part in output)
    if not isinstance(output, str):
        raise p.RequestError(f"input.{i}.output must be a string", param=f"input.{i}.output")
    return {"role": "tool", "tool_call_id": _string_field(i, item, "call_id"), "content": output}


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise p.RequestError(f"input.{i}.role must be one of {', '.join(INPUT_ROLES)}, got "
                             f"{p.short_repr(role)}", param=f"input.{i}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise p.RequestError(f"input.{i}.content must be a string or a list of content parts",
                             param=f"input.{i}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES \
                or not isinstance(part.get("text"), str):
            raise p.RequestError(f"input.{i}.content.{j}: only text parts ({{'type': "
                                 f"'input_text', 'text': ...}}) are supported",
                                 param=f"input.{i}.content")
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}


# ---- the response ---------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[Union[OutputMessage, FunctionCallItem]]
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = False
    previous_response_id: Optional[str] = None
    store: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Union[str, dict[str, Any]] = "none"
    tools: list[Any] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
