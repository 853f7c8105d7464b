"""POST /v1/chat/completions: the messages rendered through the model's chat template, n samples."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Optional

from fastapi import Request
from fastapi.responses import Response

from rooflm.engine.outputs import RequestOutput
from rooflm.server import protocol as p
from rooflm.server.admission import submit
from rooflm.server.generation import answer
from rooflm.server.logprobs import new_entries
from rooflm.server.prompts import chat_prompt
from rooflm.server.request_id import engine_base_id
from rooflm.server.streaming import sse
from rooflm.server.structured import prepare_constraint
from rooflm.server.tools import ToolCalling, ToolCallStream, check_tools, tool_calls_out

if TYPE_CHECKING:
    from rooflm.server.state import ServerState


class ChatHandler:
    def __init__(self, state: "ServerState", request: p.ChatCompletionRequest, arrival: float):
        self.state = state
        self.request = request
        self.arrival = arrival
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.num_top = request.num_logprobs()
        self.tools: Optional[ToolCalling] = None
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice

    async def __call__(self, raw: Request) -> Response:
        # The X-Request-Id names the response and its engine requests (request_id.py).
        self.id = f"chatcmpl-{engine_base_id(raw)}"
        request = self.request
        check_tools(request)
        tokenizer = self.state.tokenizer
        self.tools = ToolCalling(request, tokenizer.chat_template if tokenizer is not None else None)
        await prepare_constraint(request, self.tools.constraint())
        prompt = await chat_prompt(tokenizer, request, self.state.config.split_special_tokens)
        # Chat has no default max_tokens: up to the context length.
        generation = await submit(self.state, self.id, [prompt], request, self.arrival, None)
        return await answer(raw, generation, request.stream, self, request.include_usage_in_stream,
                            lambda finals: self.response(finals[0], generation.usage()),
                            continuous_usage=request.continuous_usage_in_stream)

    def _logprobs(self, token_ids: list[int], entries: list[Optional[dict]]) -> Optional[p.ChatLogprobs]:
        if self.num_top is None:
            return None
        return self.state.logprobs.chat(token_ids, entries, self.num_top)

    def response(self, out: RequestOutput, usage: p.UsageInfo) -> p.ChatCompletionResponse:
        choices = []
        for sample in out.outputs:
            logprobs = self._logprobs(sample.token_ids, sample.logprobs or [])
            content, calls = self.tools.extract(sample.text)
            message = p.ChatResponseMessage(content=content, tool_calls=tool_calls_out(calls) or None)
            finish_reason = "tool_calls" if calls else sample.finish_reason
            choices.append(p.ChatChoice(index=sample.index, message=message, logprobs=logprobs,
                                        finish_reason=finish_reason))
        return p.ChatCompletionResponse(id=self.id, created=self.created,
                                        model=self.state.model_name, choices=choices, usage=usage)

    # ---- the stream (streaming.ChunkFormat) ------------------------------------------------------

    def opening(self) -> list[str]:
        # The role comes first, once per choice, as OpenAI sends it.
        roles = [p.ChatStreamChoice(index=i, delta=p.ChatDelta(role="assistant", content=""))
                 for i in range(self.request.num_samples)]
        return [self.chunk(roles)]

    def chunk(self, choices: list[p.ChatStreamChoice], usage: Optional[p.UsageInfo] = None) -> str:
        chunk = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.state.model_name,
                                      choices=choices, usage=usage)
        return sse(chunk.model_dump_json())

    def stream_choices(self, index: int, out: RequestOutput) -> list[p.ChatStreamChoice]:
        choices = [self._stream_choice(out, position) for position in range(len(out.outputs))]
        return [choice for choice in choices if choice is not None]

    def _stream_choice(self, out: RequestOutput, position: int) -> Optional[p.ChatStreamChoice]:
        sample = out.outputs[position]
        text = out.delta_text[position] if position < len(out.delta_text) else ""
        new_ids = out.delta_token_ids[position] if position < len(out.delta_token_ids) else []
        logprobs = self._logprobs(new_ids, new_entries(sample, len(new_ids)))
        stream = self._tool_streams.setdefault(sample.index, self.tools.stream())
        text, calls = stream.feed(text)
        finish_reason = sample.finish_reason
        if finish_reason:
            tail, more = stream.finish()
            text, calls = text + tail, calls + more
            if stream.called:
                finish_reason = "tool_calls"
        if not text and not calls and not finish_reason and not (logprobs and logprobs.content):
            return None
        delta = p.ChatDelta(content=text or None, tool_calls=calls or None)
        return p.ChatStreamChoice(index=sample.index, delta=delta, logprobs=logprobs,
                                  finish_reason=finish_reason)
