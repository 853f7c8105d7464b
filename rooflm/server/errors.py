"""Every failure as OpenAI's error answer: {"error": {"message", "type", "param", "code"}}.

Client errors are protocol.RequestError (400 unless told otherwise). What the
engine refuses arrives as rooflm.errors.InvalidRequest, whose param is in the
engine's vocabulary; the request says which of its own fields that is. A
request that was admitted and then could not finish gets a server_error.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from rooflm.engine.request_types import EngineDeadError, RequestAborted
from rooflm.errors import InvalidRequest
from rooflm.server import protocol as p


class GenerationTimeout(Exception):
    """An admitted request ran past the server's request timeout."""


def error_body(error: p.RequestError) -> p.ErrorResponse:
    return p.ErrorResponse(error=p.ErrorInfo(message=error.message, type=error.err_type,
                                             param=error.param, code=error.code))


def error_response(error: p.RequestError) -> JSONResponse:
    return JSONResponse(error_body(error).model_dump(), status_code=error.status,
                        headers=error.headers)


def server_error(message: str, status: int, code: str) -> p.RequestError:
    return p.RequestError(message, status=status, err_type="server_error", code=code)


def invalid_request_error(exc: InvalidRequest, request: p.SamplingRequest) -> p.RequestError:
    """An engine or SamplingParams refusal, naming the field as the client sent it."""
    return p.RequestError(str(exc), param=request.field_for(exc.param))


def generation_error(exc: BaseException) -> p.RequestError:
    """What a client is told when its admitted request cannot finish."""
    if isinstance(exc, EngineDeadError):
        return server_error(str(exc), 500, "engine_error")
    if isinstance(exc, RequestAborted):
        return server_error(f"the request was aborted: {exc}", 503, "aborted")
    if isinstance(exc, GenerationTimeout):
        return server_error(str(exc), 504, "timeout")
    return server_error(f"internal error: {type(exc).__name__}", 500, "internal_error")
