"""Server-Sent Events: one generation as a stream of chunks, ended the same way for every API.

A stream is: the API's opening chunks (chat sends the role), a chunk per engine
step that produced something, the usage chunk when stream_options asks for it,
then `data: [DONE]`. The status line (200) is sent with the first chunk, so a
failure after that can only be told in the stream: one error event in OpenAI's
error shape, then [DONE] all the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional, Protocol

from fastapi.responses import StreamingResponse

from rooflm.engine.outputs import RequestOutput
from rooflm.server import protocol as p
from rooflm.server.errors import error_body, generation_error

if TYPE_CHECKING:
    from rooflm.server.generation import Generation

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(error: p.RequestError) -> str:
    return sse(error_body(error).model_dump_json())


class ChunkFormat(Protocol):
    """How one API (completions, chat) writes its stream's chunks."""

    def opening(self) -> list[str]:
        """Chunks sent before any output."""

    def stream_choices(self, index: int, out: RequestOutput) -> list:
        """The choices of prompt `index`'s new output; empty: nothing worth a chunk."""

    def chunk(self, choices: list, usage: Optional[p.UsageInfo] = None) -> str:
        """One SSE event."""


async def stream_events(generation: "Generation", fmt: ChunkFormat,
                        include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
    """continuous_usage (stream_options.continuous_usage_stats): each output chunk carries the
    usage so far (the prompts, the tokens generated up to it), as vLLM's do."""
    for chunk in fmt.opening():
        yield chunk
    try:
        async for index, out in generation.outputs():
            choices = fmt.stream_choices(index, out)
            if choices:
                yield fmt.chunk(choices, usage=generation.usage() if continuous_usage else None)
        if include_usage:
            yield fmt.chunk([], usage=generation.usage())
    except Exception as exc:  # noqa: BLE001 - the status line is sent; errors go in the stream
        yield sse_error(generation_error(exc))
    yield SSE_DONE


class EngineStreamingResponse(StreamingResponse):
    """A stream whose cleanup runs however the response ends.

    The generator's own `finally` does not run if the client leaves before the
    first chunk is pulled; this wrapper's does, so abandoned requests are
    always aborted and their blocks freed.
    """

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
