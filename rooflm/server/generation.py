"""One admitted HTTP request: its engine requests (one per prompt), their outputs, and its answer.

However the answer ends (done, client gone, timeout, error), close() aborts the
engine requests that have not finished, which frees their KV blocks at the
engine's next step.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from rooflm.engine.client import RequestStream
from rooflm.engine.outputs import RequestOutput
from rooflm.server import protocol as p
from rooflm.server.access_log import note_generation
from rooflm.server.errors import GenerationTimeout, generation_error
from rooflm.server.streaming import ChunkFormat, EngineStreamingResponse, stream_events

if TYPE_CHECKING:
    from rooflm.server.state import ServerState

_timeout = getattr(asyncio, "timeout", None)


class Generation:
    def __init__(self, state: "ServerState", streams: list[RequestStream], deadline: Optional[float]):
        self.state = state
        self.streams = streams
        self.deadline = deadline
        self.latest: list[Optional[RequestOutput]] = [None] * len(streams)
        self._closed = False
        state.active_requests += 1

    def remaining(self) -> Optional[float]:
        if self.deadline is None:
            return None
        return max(self.deadline - time.monotonic(), 0.0)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as each engine request advances, in step order per prompt."""
        if len(self.streams) == 1:
            async for out in self._one_output_stream():
                yield 0, out
            return
        pending: dict[asyncio.Future, int] = {}
        for index, stream in enumerate(self.streams):
            pending[asyncio.ensure_future(stream.next())] = index
        try:
            while pending:
                done, _ = await asyncio.wait(pending, timeout=self.remaining(),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise GenerationTimeout(f"the request ran past the server's request timeout "
                                            f"of {self.state.config.request_timeout:g} s")
                for future in done:
                    index = pending.pop(future)
                    out = future.result()
                    self.latest[index] = out
                    if not self.streams[index].finished:
                        pending[asyncio.ensure_future(self.streams[index].next())] = index
                    yield index, out
        finally:
            for future in pending:
                future.cancel()

    async def _one_output_stream(self) -> AsyncIterator[RequestOutput]:
        """outputs() for one prompt, the common case: awaits the stream directly, without a
        task and a wait set per token (a few tens of microseconds each, per streamed chunk)."""
        stream = self.streams[0]
        while not stream.finished:
            try:
                remaining = self.remaining()
                if remaining is None:
                    out = await stream.next()
                elif _timeout is not None:  # a timer handle, not a task per token (Python 3.11+)
                    async with _timeout(remaining):
                        out = await stream.next()
                else:
                    out = await stream.next(remaining)
            except asyncio.TimeoutError:
                raise GenerationTimeout(f"the request ran past the server's request timeout "
                                        f"of {self.state.config.request_timeout:g} s") from None
            self.latest[0] = out
            yield out

    async def finals(self) -> list[RequestOutput]:
        async for _ in self.outputs():
            pass
        return list(self.latest)

    def close(self) -> None:
        """Abort what has not finished (client gone, timeout, error); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.state.active_requests -= 1
        unfinished = [s.request_id for s in self.streams if not s.finished]
        self.state.engine_client.abort(unfinished)

    def usage(self) -> p.UsageInfo:
        finals = [out for out in self.latest if out is not None]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals)
        return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens,
                           prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work):
    """Await `work`, cancelling it if the client goes away first (returns None then).

    Non-streaming handlers otherwise never notice a client that left, and its
    request would keep the engine busy until max_tokens.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        return None
    finally:
        for task in (work_task, watch_task):
            task.cancel()


async def answer(raw: Request, generation: Generation, stream: bool, fmt: ChunkFormat,
                 include_usage: bool, build: Callable[[list[RequestOutput]], BaseModel],
                 continuous_usage: bool = False) -> Response:
    """An SSE stream of the generation's chunks, or the JSON of build(final outputs) once all
    are done; a client gone before then gets nothing."""
    note_generation(raw.scope, generation)
    if stream:
        return EngineStreamingResponse(stream_events(generation, fmt, include_usage, continuous_usage),
                                       on_close=generation.close)
    try:
        finals = await run_unless_disconnected(raw, generation.finals())
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error answer
        raise generation_error(exc) from None
    finally:
        generation.close()
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(build(finals).model_dump())
