"""POST /v1/responses: the Responses API's core, served through the chat path.

The input becomes chat messages (instructions first, as the system turn), which
go through the same checks, chat template and admission as
/v1/chat/completions; errors name the Responses fields (max_output_tokens,
input). One sample per request (the API has no n). A request that stops at
max_output_tokens is "incomplete", as OpenAI reports it.

Streaming sends OpenAI's event sequence, each as `event: <type>` + `data:`:
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per engine step
with text), response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed (or response.incomplete).
A failure after the stream began is an `error` event, then response.failed.
The Responses API has no `data: [DONE]`.
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

if TYPE_CHECKING:
    from rooflm.server.state import ServerState


class ResponsesChatRequest(p.ChatCompletionRequest):
    """A Responses request as the chat path sees it, naming fields as the client sent them."""

    def max_tokens_field(self) -> str:
        return "max_output_tokens"

    def field_for(self, param: Optional[str]) -> Optional[str]:
        if param in ("prompt", "messages"):
            return "input"
        return super().field_for(param)


async def create_response(state: "ServerState", raw: Request, body: dict,
                          arrival: float) -> Response:
    request = p.validate_request(rp.ResponsesRequest, body)
    state.check_model(request.model)
    request.check()
    state.log_ignored(request, request_id(raw))
    chat = p.validate_request(ResponsesChatRequest, {
        "model": request.model, "messages": request.messages(),
        "max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
        "top_p": request.top_p})
    chat.check(state.limits)
    try:
        prompt = await chat_prompt(state.tokenizer, chat)
    except p.RequestError as exc:
        exc.param = chat.field_for(exc.param)
        raise
    handler = ResponseHandler(state, request, engine_base_id(raw))
    generation = await submit(state, handler.id, [prompt], chat, arrival, None)
    if request.stream:
        note_generation(raw.scope, generation)
        return EngineStreamingResponse(handler.events(generation), on_close=generation.close)
    return await answer(raw, generation, False, None, False,
                        lambda finals: handler.response(finals[0], generation))


class ResponseHandler:
    def __init__(self, state: "ServerState", request: rp.ResponsesRequest, base_id: str):
        self.state = state
        self.request = request
        self.id = f"resp_{base_id}"
        self.message_id = f"msg_{base_id}"
        self.created_at = int(time.time())
        self._sequence = 0

    def _object(self, status: str, output: list[rp.OutputMessage],
                usage: Optional[rp.ResponseUsage] = None,
                error: Optional[rp.ResponseError] = None) -> rp.ResponseObject:
        request = self.request
        incomplete = rp.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return rp.ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.state.model_name,
            output=output, error=error, incomplete_details=incomplete,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {}, temperature=request.temperature, top_p=request.top_p,
            tool_choice=request.tool_choice or "none", user=request.user,
            truncation=request.truncation or "disabled",
            parallel_tool_calls=bool(request.parallel_tool_calls), usage=usage)

    @staticmethod
    def _status(out: RequestOutput) -> str:
        return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"

    def _message(self, text: str, status: str) -> rp.OutputMessage:
        return rp.OutputMessage(id=self.message_id, status=status, content=[rp.OutputText(text=text)])

    @staticmethod
    def _usage(generation: Generation) -> rp.ResponseUsage:
        usage = generation.usage()
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return rp.ResponseUsage(input_tokens=usage.prompt_tokens,
                                input_tokens_details=rp.InputTokensDetails(cached_tokens=cached),
                                output_tokens=usage.completion_tokens,
                                total_tokens=usage.total_tokens)

    def response(self, out: RequestOutput, generation: Generation) -> rp.ResponseObject:
        status = self._status(out)
        return self._object(status, [self._message(out.outputs[0].text, status)],
                            self._usage(generation))

    # ---- the stream ----------------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(payload, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        common = {"item_id": self.message_id, "output_index": 0}
        yield self._event("response.created", response=self._object("in_progress", []).model_dump())
        yield self._event("response.in_progress",
                          response=self._object("in_progress", []).model_dump())
        yield self._event("response.output_item.added", output_index=0,
                          item=rp.OutputMessage(id=self.message_id, status="in_progress",
                                                content=[]).model_dump())
        yield self._event("response.content_part.added", **common, content_index=0,
                          part=rp.OutputText(text="").model_dump())
        text, out = "", None
        try:
            async for _, out in generation.outputs():
                delta = out.delta_text[0] if out.delta_text else ""
                if delta:
                    text += delta
                    yield self._event("response.output_text.delta", **common, content_index=0,
                                      delta=delta, logprobs=[])
        except Exception as exc:  # noqa: BLE001 - the status line is sent; errors go in the stream
            error = generation_error(exc)
            yield self._event("error", code=error.code, message=error.message, param=error.param)
            failed = self._object("failed", [self._message(text, "incomplete")],
                                  error=rp.ResponseError(code=error.code or "server_error",
                                                         message=error.message))
            yield self._event("response.failed", response=failed.model_dump())
            return
        text = out.outputs[0].text  # the whole, as the engine holds it
        status = self._status(out)
        part = rp.OutputText(text=text)
        yield self._event("response.output_text.done", **common, content_index=0, text=text,
                          logprobs=[])
        yield self._event("response.content_part.done", **common, content_index=0,
                          part=part.model_dump())
        yield self._event("response.output_item.done", output_index=0,
                          item=self._message(text, status).model_dump())
        final = self._object(status, [self._message(text, status)], self._usage(generation))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self._event(kind, response=final.model_dump())
