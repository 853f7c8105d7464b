"""POST /v1/responses: the Responses API's core, served through the chat path.

The input becomes chat messages (instructions first, as the system turn), which
go through the same checks, chat template and admission as
/v1/chat/completions; errors name the Responses fields (max_output_tokens,
input, text.format). `text.format` json_object / json_schema is chat's
response_format. One sample per request (the API has no n). A request that stops at
max_output_tokens is "incomplete", as OpenAI reports it.

Function tools go through chat's tool machinery (server/tools.py): the same
template, tool_choice constraints and parsers; each call is a `function_call`
output item (call_id, name, arguments) after the message item, if the reply
had text before its calls.

Streaming sends OpenAI's event sequence, each as `event: <type>` + `data:`:
response.created, response.in_progress, then per output item
response.output_item.added ... response.output_item.done. A message item has
response.content_part.added, response.output_text.delta (one per engine step
with text), response.output_text.done, response.content_part.done; a
function_call item has response.function_call_arguments.delta (fragments, as
the model writes them) and response.function_call_arguments.done. Then
response.completed (or response.incomplete). Without tools the message item
opens at once; with tools it opens at the first text, so a reply that is only
calls has only function_call items. A failure after the stream began is an
`error` event, then response.failed. The Responses API has no `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from rooflm.engine.outputs import RequestOutput
from rooflm.server import protocol as p
from rooflm.server import responses_protocol as rp
from rooflm.server.access_log import note_generation
from rooflm.server.admission import submit
from rooflm.server.errors import generation_error
from rooflm.server.generation import Generation, answer
from rooflm.server.prompts import chat_prompt
from rooflm.server.request_id import engine_base_id, request_id
from rooflm.server.streaming import EngineStreamingResponse
from rooflm.server.structured import prepare_constraint
from rooflm.server.tools import ToolCalling, check_tools

if TYPE_CHECKING:
    from rooflm.server.state import ServerState


class ResponsesChatRequest(p.ChatCompletionRequest):
    """A Responses request as the chat path sees it, naming fields as the client sent them."""

    def max_tokens_field(self) -> str:
        return "max_output_tokens"

    def field_for(self, param: Optional[str]) -> Optional[str]:
        if param in ("prompt", "messages"):
            return "input"
        if param == "response_format":
            return "text.format"
        return super().field_for(param)


async def create_response(state: "ServerState", raw: Request, body: dict,
                          arrival: float) -> Response:
    request = p.validate_request(rp.ResponsesRequest, body)
    state.check_model(request.model)
    request.check()
    state.log_ignored(request, request_id(raw))
    body = {"model": request.model, "messages": request.messages(),
            "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p,
            "tools": request.chat_tools(), "tool_choice": request.chat_tool_choice(),
            "parallel_tool_calls": request.parallel_tool_calls,
            "response_format": request.chat_response_format()}
    chat = p.validate_request(ResponsesChatRequest, {k: v for k, v in body.items() if v is not None})
    chat.check(state.limits)
    check_tools(chat)
    tokenizer = state.tokenizer
    tools = ToolCalling(chat, tokenizer.chat_template if tokenizer is not None else None)
    try:
        await prepare_constraint(chat, tools.constraint())
        prompt = await chat_prompt(tokenizer, chat, state.config.split_special_tokens)
    except p.RequestError as exc:
        exc.param = chat.field_for(exc.param)
        raise
    handler = ResponseHandler(state, request, engine_base_id(raw), tools)
    generation = await submit(state, handler.id, [prompt], chat, arrival, None)
    if request.stream:
        note_generation(raw.scope, generation)
        return EngineStreamingResponse(handler.events(generation), on_close=generation.close)
    return await answer(raw, generation, False, None, False,
                        lambda finals: handler.response(finals[0], generation))


class ResponseHandler:
    def __init__(self, state: "ServerState", request: rp.ResponsesRequest, base_id: str,
                 tools: ToolCalling):
        self.state = state
        self.request = request
        self.tools = tools
        self.id = f"resp_{base_id}"
        self.message_id = f"msg_{base_id}"
        self.created_at = int(time.time())
        self._sequence = 0

    def _object(self, status: str, output: list,
                usage: Optional[rp.ResponseUsage] = None,
                error: Optional[rp.ResponseError] = None) -> rp.ResponseObject:
        request = self.request
        incomplete = rp.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return rp.ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.state.model_name,
            output=output, error=error, incomplete_details=incomplete,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {}, temperature=request.temperature, top_p=request.top_p,
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            tools=request.tools or [], user=request.user,
            text=request.text if (request.text or {}).get("format") else {"format": {"type": "text"}},
            truncation=request.truncation or "disabled",
            parallel_tool_calls=request.parallel_tool_calls is not False, usage=usage)

    @staticmethod
    def _status(out: RequestOutput, called: bool = False) -> str:
        if called:
            return "completed"
        return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"

    def _message(self, text: str, status: str) -> rp.OutputMessage:
        return rp.OutputMessage(id=self.message_id, status=status, content=[rp.OutputText(text=text)])

    @staticmethod
    def _function_call(call_id: str, name: str, arguments: str, status: str) -> rp.FunctionCallItem:
        # The item's id and the call's id differ in OpenAI's API (fc_... and call_...).
        return rp.FunctionCallItem(id=f"fc_{call_id.removeprefix('call_')}", call_id=call_id,
                                   name=name, arguments=arguments, status=status)

    @staticmethod
    def _usage(generation: Generation) -> rp.ResponseUsage:
        usage = generation.usage()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return rp.ResponseUsage(input_tokens=usage.prompt_tokens,
                                input_tokens_details=rp.InputTokensDetails(cached_tokens=cached),
                                output_tokens=usage.completion_tokens,
                                total_tokens=usage.total_tokens)

    def response(self, out: RequestOutput, generation: Generation) -> rp.ResponseObject:
        content, calls = self.tools.extract(out.outputs[0].text)
        status = self._status(out, bool(calls))
        output: list = []
        if content or not calls:
            output.append(self._message(content or "", status))
        output.extend(self._function_call(c.id, c.name, c.arguments, "completed") for c in calls)
        return self._object(status, output, self._usage(generation))

    # ---- the stream ----------------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(payload, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._object("in_progress", []).model_dump())
        yield self._event("response.in_progress",
                          response=self._object("in_progress", []).model_dump())
        items = _StreamItems(self)
        if self.tools.mode == "none":
            for event in items.open_message():
                yield event
        stream = self.tools.stream()
        out = None
        try:
            async for _, out in generation.outputs():
                delta = out.delta_text[0] if out.delta_text else ""
                content, calls = stream.feed(delta)
                if out.outputs[0].finish_reason:
                    tail, more = stream.finish()
                    content, calls = content + tail, calls + more
                for event in items.add(content, calls):
                    yield event
        except Exception as exc:  # noqa: BLE001 - the status line is sent; errors go in the stream
            error = generation_error(exc)
            yield self._event("error", code=error.code, message=error.message, param=error.param)
            failed = self._object("failed", items.output("incomplete"),
                                  error=rp.ResponseError(code=error.code or "server_error",
                                                         message=error.message))
            yield self._event("response.failed", response=failed.model_dump())
            return
        status = self._status(out, bool(items.calls))
        if items.message_text is None and not items.calls:
            for event in items.open_message():  # nothing at all came: an empty message
                yield event
        for event in items.close(status):
            yield event
        final = self._object(status, items.output(status), self._usage(generation))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self._event(kind, response=final.model_dump())


class _StreamItems:
    """The output items of one streamed response, opened and closed as text and calls come."""

    def __init__(self, handler: ResponseHandler):
        self.handler = handler
        self.message_text: Optional[str] = None  # None: no message item opened
        self.message_index = 0
        self.message_done = False
        self.calls: list[list[str]] = []  # [call_id, name, arguments] per call, in order
        self.call_index: dict[int, int] = {}  # the tool stream's call index -> output_index
        self._open_call: Optional[int] = None  # the call whose arguments are streaming
        self._num_items = 0

    def _event(self, kind: str, **fields) -> str:
        return self.handler._event(kind, **fields)

    def open_message(self) -> list[str]:
        self.message_text, self.message_index = "", self._num_items
        self._num_items += 1
        h = self.handler
        return [self._event("response.output_item.added", output_index=self.message_index,
                            item=rp.OutputMessage(id=h.message_id, status="in_progress",
                                                  content=[]).model_dump()),
                self._event("response.content_part.added", item_id=h.message_id,
                            output_index=self.message_index, content_index=0,
                            part=rp.OutputText(text="").model_dump())]

    def add(self, content: str, calls: list[p.DeltaToolCall]) -> list[str]:
        events = []
        if content and not self.calls:  # text after calls is not part of the reply
            if self.message_text is None:
                events += self.open_message()
            self.message_text += content
            events.append(self._event("response.output_text.delta", item_id=self.handler.message_id,
                                      output_index=self.message_index, content_index=0,
                                      delta=content, logprobs=[]))
        for delta in calls:
            if delta.id is not None:
                events += self._close_message("completed") + self._close_call("completed")
                events += self._open_function_call(delta)
            fragment = delta.function.arguments if delta.function else None
            if fragment:
                index = self.call_index[delta.index]
                self.calls[index][2] += fragment
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=self._item_id(index),
                                          output_index=self._output_index(index), delta=fragment))
        return events

    def _item_id(self, index: int) -> str:
        return f"fc_{self.calls[index][0].removeprefix('call_')}"

    def _output_index(self, index: int) -> int:
        return self._num_items - len(self.calls) + index

    def _open_function_call(self, delta: p.DeltaToolCall) -> list[str]:
        self.calls.append([delta.id, delta.function.name, ""])
        index = len(self.calls) - 1
        self.call_index[delta.index] = index
        self._open_call = index
        self._num_items += 1
        item = self.handler._function_call(delta.id, delta.function.name, "", "in_progress")
        return [self._event("response.output_item.added", output_index=self._output_index(index),
                            item=item.model_dump())]

    def _close_message(self, status: str) -> list[str]:
        if self.message_text is None or self.message_done:
            return []
        self.message_done = True
        h, text = self.handler, self.message_text
        common = {"item_id": h.message_id, "output_index": self.message_index, "content_index": 0}
        return [self._event("response.output_text.done", **common, text=text, logprobs=[]),
                self._event("response.content_part.done", **common,
                            part=rp.OutputText(text=text).model_dump()),
                self._event("response.output_item.done", output_index=self.message_index,
                            item=h._message(text, status).model_dump())]

    def _close_call(self, status: str) -> list[str]:
        if self._open_call is None:
            return []
        index, self._open_call = self._open_call, None
        call_id, name, arguments = self.calls[index]
        item = self.handler._function_call(call_id, name, arguments, status)
        return [self._event("response.function_call_arguments.done", item_id=item.id,
                            output_index=self._output_index(index), name=name,
                            arguments=arguments),
                self._event("response.output_item.done", output_index=self._output_index(index),
                            item=item.model_dump())]

    def close(self, status: str) -> list[str]:
        return self._close_message(status) + self._close_call("completed")

    def output(self, status: str) -> list:
        h = self.handler
        items: list = []
        if self.message_text is not None:
            items.append(h._message(self.message_text, status))
        items.extend(h._function_call(call_id, name, arguments, "completed")
                     for call_id, name, arguments in self.calls)
        return items
