"""Admission: a checked request's prompts become engine requests, admitted all together or none.

Per prompt, max_tokens is resolved against the context length with the
engine's own rule (sampling_params.resolve_max_tokens), here first: a request
that can never fit must be a 400 naming the field, not be weighed as a
reservation (and refused for its size) or queued. Then SamplingParams, then
the reservation: prompt + n x max_tokens, which a request that could never be
admitted exceeds (400) and one that only has to wait meets in the async
engine (429). Whatever the engine still refuses comes back as InvalidRequest.
Every refusal names the field as the client sent it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Optional

from rooflm.engine.client import RequestStream
from rooflm.engine.request_types import AdmissionRejected, EngineDeadError, GenerateRequest
from rooflm.errors import InvalidRequest
from rooflm.sampling_params import resolve_max_tokens
from rooflm.server import protocol as p
from rooflm.server.errors import invalid_request_error, server_error
from rooflm.server.generation import Generation
from rooflm.server.prompts import PreparedPrompt

if TYPE_CHECKING:
    from rooflm.server.state import ServerState


async def submit(state: "ServerState", base_id: str, prompts: list[PreparedPrompt],
                 request: p.SamplingRequest, arrival: float, default_max_tokens: Optional[int],
                 prompt_logprobs: Optional[int] = None) -> Generation:
    """Admit one engine request per prompt; default_max_tokens: None is up to the context."""
    state.check_accepting()  # a drain may have begun while the prompt was tokenized
    try:
        requests = [_engine_request(state, f"{base_id}-{index}", prompt, request, arrival,
                                    default_max_tokens, prompt_logprobs)
                    for index, prompt in enumerate(prompts)]
    except InvalidRequest as exc:
        raise invalid_request_error(exc, request) from None
    _check_reservation(state, requests, request.max_tokens_field())
    deadline = None
    if state.config.request_timeout > 0:
        deadline = arrival + state.config.request_timeout
    streams = await _admit(state, requests, request, deadline)
    return Generation(state, streams, deadline)


def _engine_request(state: "ServerState", request_id: str, prompt: PreparedPrompt,
                    request: p.SamplingRequest, arrival: float, default_max_tokens: Optional[int],
                    prompt_logprobs: Optional[int]) -> GenerateRequest:
    max_tokens = request.requested_max_tokens()
    if max_tokens is None:
        max_tokens = default_max_tokens
    max_tokens = resolve_max_tokens(max_tokens, len(prompt.token_ids), state.info.max_model_len)
    params = request.sampling_params(max_tokens, prompt_logprobs)
    return GenerateRequest(request_id, prompt.token_ids, params, request.cache_salt, arrival,
                           priority=request.priority or 0, deadline_ms=request.deadline_ms,
                           lora_request=state.lora_of(request.model))


def _check_reservation(state: "ServerState", requests: list[GenerateRequest],
                       max_tokens_field: str) -> None:
    """A request that could never be admitted is the client's error (400), not a 429."""
    queue = state.config.max_queued_requests
    if len(requests) > queue:
        raise p.RequestError(f"the request has {len(requests)} prompts, more than the server's "
                             f"queue of {queue}", param="prompt")
    reserved = sum(r.reserved_tokens for r in requests)
    cap = state.max_tokens_in_flight
    if cap and reserved > cap:
        raise p.RequestError(f"the request may need {reserved} tokens (prompt + n x "
                             f"{max_tokens_field}), more than the server's limit of {cap} "
                             f"tokens in flight; lower {max_tokens_field} or n",
                             param=max_tokens_field)


async def _admit(state: "ServerState", requests: list[GenerateRequest], request: p.SamplingRequest,
                 deadline: Optional[float]) -> list[RequestStream]:
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    try:
        return await asyncio.wait_for(state.engine_client.generate(requests), timeout)
    except AdmissionRejected as exc:
        if exc.code == "slo_shed":
            state.metrics.observe_shed()
        err_type = "rate_limit_error" if exc.status == 429 else "server_error"
        raise p.RequestError(str(exc), status=exc.status, err_type=err_type, code=exc.code,
                             headers={"Retry-After": str(exc.retry_after_s)}) from None
    except InvalidRequest as exc:
        raise invalid_request_error(exc, request) from None
    except EngineDeadError as exc:
        raise server_error(str(exc), 503, "engine_error") from None
    except asyncio.TimeoutError:
        raise server_error("the request timed out waiting for admission", 504, "timeout") from None
