"""POST /v1/completions: one or more prompts, n samples each, echo and logprobs.

Choice i*n + j is sample j of prompt i, as OpenAI numbers them.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Optional

from fastapi import Request
from fastapi.responses import Response

from rooflm.engine.outputs import CompletionOutput, RequestOutput
from rooflm.server import protocol as p
from rooflm.server.admission import submit
from rooflm.server.generation import answer
from rooflm.server.logprobs import join_logprobs, new_entries
from rooflm.server.prompts import PreparedPrompt, completion_prompts, prompt_text
from rooflm.server.request_id import engine_base_id
from rooflm.server.streaming import sse
from rooflm.server.structured import prepare_constraint

if TYPE_CHECKING:
    from rooflm.server.state import ServerState


class CompletionHandler:
    def __init__(self, state: "ServerState", request: p.CompletionRequest, arrival: float):
        self.state = state
        self.request = request
        self.arrival = arrival
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = request.num_samples
        self.num_top = request.logprobs
        self.prompts: list[PreparedPrompt] = []
        self._started: set[int] = set()  # choices streamed so far: the first carries the echo

    async def __call__(self, raw: Request) -> Response:
        # The X-Request-Id names the response and its engine requests (request_id.py).
        self.id = f"cmpl-{engine_base_id(raw)}"
        request = self.request
        await prepare_constraint(request)
        self.prompts = await completion_prompts(self.state.tokenizer, request)
        # echo with logprobs also scores the prompt, as OpenAI's API does.
        prompt_logprobs = self.num_top if request.echo and self.num_top is not None else None
        generation = await submit(self.state, self.id, self.prompts, request, self.arrival,
                                  p.CompletionRequest.DEFAULT_MAX_TOKENS, prompt_logprobs)
        return await answer(raw, generation, request.stream, self, request.include_usage_in_stream,
                            lambda finals: self.response(finals, generation.usage()),
                            continuous_usage=request.continuous_usage_in_stream)

    # ---- logprobs and echo -----------------------------------------------------------------------

    def _logprobs(self, token_ids: list[int],
                  entries: list[Optional[dict]]) -> Optional[p.CompletionLogprobs]:
        if self.num_top is None:
            return None
        return self.state.logprobs.completion(token_ids, entries, self.num_top)

    def _echo(self, index: int, out: RequestOutput, text: str,
              logprobs: Optional[p.CompletionLogprobs]) -> tuple[str, Optional[p.CompletionLogprobs]]:
        """The prompt (and its logprobs) put before a choice's first text."""
        prompt = self.prompts[index]
        if logprobs is not None:
            entries = out.prompt_logprobs or [None] * len(prompt.token_ids)
            logprobs = join_logprobs(self._logprobs(prompt.token_ids, entries), logprobs)
        return prompt_text(self.state.tokenizer, prompt) + text, logprobs

    # ---- the whole answer ---------------------------------------------------------------------------

    def _choice(self, index: int, out: RequestOutput, sample: CompletionOutput) -> p.CompletionChoice:
        text = sample.text
        logprobs = self._logprobs(sample.token_ids, sample.logprobs or [])
        if self.request.echo:
            text, logprobs = self._echo(index, out, text, logprobs)
        return p.CompletionChoice(index=index * self.n + sample.index, text=text, logprobs=logprobs,
                                  finish_reason=sample.finish_reason)

    def response(self, finals: list[RequestOutput], usage: p.UsageInfo) -> p.CompletionResponse:
        choices = [self._choice(index, out, sample)
                   for index, out in enumerate(finals) for sample in out.outputs]
        return p.CompletionResponse(id=self.id, created=self.created, model=self.state.model_name,
                                    choices=choices, usage=usage)

    # ---- the stream (streaming.ChunkFormat) ------------------------------------------------------

    def opening(self) -> list[str]:
        return []

    def chunk(self, choices: list[p.CompletionChoice], usage: Optional[p.UsageInfo] = None) -> str:
        chunk = p.CompletionChunk(id=self.id, created=self.created, model=self.state.model_name,
                                  choices=choices, usage=usage)
        return sse(chunk.model_dump_json())

    def stream_choices(self, index: int, out: RequestOutput) -> list[p.CompletionChoice]:
        choices = []
        for position, sample in enumerate(out.outputs):
            choice_index = index * self.n + sample.index
            choice = self._stream_choice(index, out, position, choice_index not in self._started)
            if choice is not None:
                self._started.add(choice_index)
                choices.append(choice)
        return choices

    def _stream_choice(self, index: int, out: RequestOutput, position: int,
                       first: bool) -> Optional[p.CompletionChoice]:
        sample = out.outputs[position]
        text = out.delta_text[position] if position < len(out.delta_text) else ""
        new_ids = out.delta_token_ids[position] if position < len(out.delta_token_ids) else []
        logprobs = self._logprobs(new_ids, new_entries(sample, len(new_ids)))
        if first and self.request.echo:
            text, logprobs = self._echo(index, out, text, logprobs)
        if not text and not sample.finish_reason and not (logprobs and logprobs.tokens):
            return None
        return p.CompletionChoice(index=index * self.n + sample.index, text=text, logprobs=logprobs,
                                  finish_reason=sample.finish_reason)
