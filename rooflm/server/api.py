"""The OpenAI-compatible HTTP API: create_app() builds the FastAPI app around one engine.

A request's path through the server:
  1. middleware: the API key (Authorization: Bearer, constant-time compare),
     then CORS when origins are allowed;
  2. refuse early (503) while shutting down or after the engine died;
  3. read the body (at most max_body_bytes, else 413), decode strict UTF-8 and
     JSON, validate with the pydantic models of protocol.py (a type error is a
     400, never a 422), check the model name (404) and every range (400);
  4. render the chat template (transformers' ImmutableSandboxedEnvironment) and
     tokenize in a worker thread; check the context length (400 with both numbers);
  5. build SamplingParams (its ValueError is a 400 naming the field) and hand
     the prompts to the AsyncLLMEngine, which admits them all or refuses (429
     with Retry-After when the queue or the tokens in flight are full);
  6. stream Server-Sent Events, or wait for the end and answer once. A client
     that disconnects, or a request that runs past request_timeout, aborts its
     engine requests, which frees their KV blocks at the engine's next step.

Health: /health is 200 while the engine loop is alive and making progress;
/ready is 200 once a warm-up generation has run, until shutdown begins.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rooflm.engine.async_engine import (AdmissionLimits, AdmissionRejected, AsyncLLMEngine,
                                        EngineDeadError, GenerateRequest, RequestAborted,
                                        RequestStream)
from rooflm.engine.outputs import RequestOutput, TokenLogprob
from rooflm.sampling_params import SamplingParams
from rooflm.server import protocol as p
from rooflm.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# The default's token budget: this many times the KV cache's capacity in tokens.
# Reservations assume every request runs to max_tokens, which few do.
DEFAULT_TOKENS_IN_FLIGHT_PER_KV_TOKEN = 8

# Paths anyone may GET without the API key: probes and scrapers carry no secrets.
PUBLIC_PATHS = ("/health", "/ready", "/metrics")

# How long error answers get to reach their clients before an engine failure
# or a shutdown ends the process.
FLUSH_GRACE_S = 1.0


@dataclass(frozen=True)
class ServerConfig:
    """The server's own flags (the engine's are EngineConfig's)."""

    served_model_name: Optional[str] = None  # None: derived from the model path
    api_key: Optional[str] = None
    allowed_origins: tuple[str, ...] = ()  # empty: CORS off
    max_queued_requests: int = 64
    max_tokens_in_flight: Optional[int] = None  # None: 8 x the KV cache's tokens; 0: no cap
    max_n: int = 16
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 * 1024
    request_timeout: float = 600.0  # seconds; 0: none
    health_stall_seconds: float = 30.0
    keep_running_on_error: bool = False
    shutdown_timeout: float = 30.0
    log_interval: float = 10.0  # seconds; 0: no periodic log line
    peak_bandwidth_gbs: float = 0.0  # 0: unknown, the MBU gauge stays unset
    warmup: bool = True

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_n", "max_body_bytes", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "health_stall_seconds", "shutdown_timeout",
                     "log_interval", "peak_bandwidth_gbs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_tokens_in_flight is not None and self.max_tokens_in_flight < 0:
            raise ValueError(f"max_tokens_in_flight must be >= 0, got {self.max_tokens_in_flight}")


def derive_model_name(model_arg: Optional[str], model_path: str) -> str:
    """The name /v1/models shows: a preset name as given, else the file or folder name.

    GGUF files are named <model>.<quantization>.gguf; the quantization tag is
    not part of the model's name ("SmolLM2-135M-Instruct.Q4_1.gguf" ->
    "SmolLM2-135M-Instruct").
    """
    if model_arg is not None and not os.path.exists(model_arg):
        return model_arg
    name = os.path.basename(os.path.normpath(model_path))
    if name.lower().endswith(".gguf"):
        name = name[:-len(".gguf")]
        name = re.sub(r"[.-](I?Q\d[\w]*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)
    return name


# ---- errors -----------------------------------------------------------------------------------------


def error_response(error: p.RequestError) -> JSONResponse:
    body = p.ErrorResponse(error=p.ErrorInfo(message=error.message, type=error.err_type,
                                             param=error.param, code=error.code))
    return JSONResponse(body.model_dump(), status_code=error.status, headers=error.headers)


def _server_error(message: str, status: int, code: str) -> p.RequestError:
    return p.RequestError(message, status=status, err_type="server_error", code=code)


class GenerationTimeout(Exception):
    pass


def generation_error(exc: BaseException) -> p.RequestError:
    """What a client is told when its admitted request cannot finish."""
    if isinstance(exc, EngineDeadError):
        return _server_error(str(exc), 500, "engine_error")
    if isinstance(exc, RequestAborted):
        return _server_error(f"the request was aborted: {exc}", 503, "aborted")
    if isinstance(exc, GenerationTimeout):
        return _server_error(str(exc), 504, "timeout")
    return _server_error(f"internal error: {type(exc).__name__}", 500, "internal_error")


def _param_for_engine_error(message: str, max_tokens_field: str) -> Optional[str]:
    """The request field an engine or SamplingParams ValueError is about."""
    first_word = message.split(" ", 1)[0]
    if first_word in SamplingParams.__dataclass_fields__:
        return max_tokens_field if first_word == "max_tokens" else first_word
    if "max_tokens" in message or "KV-cache blocks" in message:
        return max_tokens_field
    if "stop_token_ids" in message:
        return "stop_token_ids"
    if "prompt" in message:
        return "prompt"
    return None


# ---- middleware ---------------------------------------------------------------------------------------


class APIKeyMiddleware:
    """Every path but the probes needs `Authorization: Bearer <key>`.

    A pure ASGI middleware: it never touches the body, so streaming and
    disconnect detection pass through it untouched.
    """

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._needs_key(scope) and not self._authorized(scope):
            error = p.RequestError("Incorrect API key provided; send Authorization: Bearer <key>",
                                   status=401, code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"})
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _needs_key(scope) -> bool:
        # CORS preflights carry no credentials by design.
        return scope["method"] != "OPTIONS" and scope["path"] not in PUBLIC_PATHS

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # compare_digest: the time taken does not tell how much of the key matched.
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False


class HeaderLimitMiddleware:
    """Request heads larger than max_header_bytes get 431.

    uvicorn's h11 limit (h11_max_incomplete_event_size) only bounds a head that
    is still arriving; one that arrives whole in a single read passes it. This
    check bounds every head, and answers in OpenAI's error shape.
    """

    def __init__(self, app, max_header_bytes: int):
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.max_header_bytes:
                error = p.RequestError(f"the request's headers are larger than the server's limit "
                                       f"of {self.max_header_bytes} bytes", status=431,
                                       code="headers_too_large")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


# ---- one admitted generation ------------------------------------------------------------------------


@dataclass
class PreparedPrompt:
    text: Optional[str]  # as sent, or the rendered chat prompt; None for token ids
    token_ids: list[int]


class Generation:
    """The engine requests of one HTTP request (one per prompt) and their outputs."""

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
        self.state.engine.abort(unfinished)

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


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(error: p.RequestError) -> str:
    body = p.ErrorResponse(error=p.ErrorInfo(message=error.message, type=error.err_type,
                                             param=error.param, code=error.code))
    return sse(body.model_dump_json())


# ---- logprobs in OpenAI's two shapes -------------------------------------------------------------------


def _ranked(entry: dict[int, TokenLogprob], limit: int) -> list[tuple[int, TokenLogprob]]:
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(tid, lp) for tid, lp in ranked if lp.rank <= limit][:limit]


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids: list[int], entries: list[Optional[dict]], num_top: int,
                   start_offset: int = 0) -> p.CompletionLogprobs:
        """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
        result = p.CompletionLogprobs()
        offset = start_offset
        for token_id, entry in zip(token_ids, entries):
            if entry is None or token_id not in entry:
                text, logprob, top = self.token_text(token_id), None, None
            else:
                text, logprob = entry[token_id].decoded, entry[token_id].logprob
                top = {lp.decoded: lp.logprob for tid, lp in entry.items()
                       if lp.rank <= num_top or tid == token_id}
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def chat(self, token_ids: list[int], entries: list[Optional[dict]],
             num_top: int) -> p.ChatLogprobs:
        content = []
        for token_id, entry in zip(token_ids, entries):
            if entry is None or token_id not in entry:
                continue
            chosen = entry[token_id]
            top = [p.ChatTopLogprob(token=lp.decoded, logprob=lp.logprob,
                                    bytes=list(lp.decoded.encode("utf-8")))
                   for _, lp in _ranked(entry, num_top)]
            content.append(p.ChatTokenLogprob(token=chosen.decoded, logprob=chosen.logprob,
                                              bytes=list(chosen.decoded.encode("utf-8")),
                                              top_logprobs=top))
        return p.ChatLogprobs(content=content)


def _new_entries(sample, count: int) -> list[Optional[dict]]:
    """The logprob entries of a sample's newest `count` tokens."""
    if not count or not sample.logprobs:
        return [None] * count
    return list(sample.logprobs[-count:])


# ---- the server's state and its handlers ------------------------------------------------------------------


class ServerState:
    """Everything the handlers share; lives at app.state.rooflm."""

    def __init__(self, config: ServerConfig, llm, model_name: str):
        self.config = config
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = llm.tokenizer
        self.metrics = ServerMetrics(model_name)
        kv_tokens = llm.block_manager.num_blocks * llm.block_manager.block_size
        tokens_cap = config.max_tokens_in_flight
        if tokens_cap is None:
            tokens_cap = DEFAULT_TOKENS_IN_FLIGHT_PER_KV_TOKEN * kv_tokens
        self.max_tokens_in_flight = tokens_cap
        self.engine = AsyncLLMEngine(
            llm, AdmissionLimits(config.max_queued_requests, tokens_cap), self.metrics,
            peak_bandwidth=config.peak_bandwidth_gbs * 1e9)
        self.limits = p.RequestLimits(max_n=config.max_n, vocab_size=llm.model_config.vocab_size,
                                      max_model_len=llm.max_model_len)
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.ready = False
        self.draining = False
        self.exit_code = 0
        self.active_requests = 0
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        # Set by whoever runs the server (rooflm serve): ends the process.
        self.request_exit: Optional[Callable[[], None]] = None
        self._background: set[asyncio.Task] = set()

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.engine.start(on_dead=self.on_engine_dead)
        if self.config.warmup:
            self._spawn(self.warm_up())
        else:
            self.ready = True
        if self.config.log_interval > 0:
            self._spawn(self.log_stats_forever())

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.to_thread(self.engine.stop)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def warm_up(self) -> None:
        """One tiny generation: the first step pays one-time costs, not a client."""
        token_id = self.llm.model_config.bos_token_id or 0
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        request = GenerateRequest(f"warmup-{uuid.uuid4().hex}", [token_id], params,
                                  record_metrics=False)
        try:
            streams = await self.engine.generate([request], bypass_limits=True)
            while not streams[0].finished:
                await streams[0].next()
        except Exception:  # noqa: BLE001 - the server stays not-ready; the reason is logged
            logger.exception("warm-up generation failed; the server is not ready")
            return
        self.ready = True
        logger.info("ready: serving %s (context length %d, %d KV blocks of %d tokens)",
                    self.model_name, self.llm.max_model_len, self.llm.block_manager.num_blocks,
                    self.llm.block_manager.block_size)

    def on_engine_dead(self, exc: BaseException) -> None:
        """Called on the event loop once the engine thread has failed every request."""
        self.ready = False
        if self.config.keep_running_on_error:
            logger.error("the engine failed; staying up (--keep-running-on-error): /health "
                         "answers 503 and new requests get 503")
            return
        logger.error("the engine failed; exiting with status 1")
        self.exit_code = 1
        self._spawn(self._exit_after_flush())

    async def _exit_after_flush(self) -> None:
        await asyncio.sleep(FLUSH_GRACE_S)
        if self.request_exit is not None:
            self.request_exit()

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work, let what runs finish, then exit (call on the loop)."""
        if not self.draining:
            self._spawn(self.drain_and_exit())

    async def drain_and_exit(self) -> None:
        self.draining = True
        timeout = self.config.shutdown_timeout
        logger.warning("shutting down: refusing new requests; waiting up to %.0f s for %d in "
                       "flight", timeout, self.active_requests)
        deadline = time.monotonic() + timeout
        while self.active_requests > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active_requests > 0:
            logger.warning("shutdown timeout: aborting %d requests", self.active_requests)
            self.engine.abort_all("the server is shutting down")
            flush_deadline = time.monotonic() + FLUSH_GRACE_S
            while self.active_requests > 0 and time.monotonic() < flush_deadline:
                await asyncio.sleep(0.05)
        if self.request_exit is not None:
            self.request_exit()

    async def log_stats_forever(self) -> None:
        snap = self.engine.snapshot
        last_time, last_tokens = time.monotonic(), snap.generation_tokens
        last_queries, last_hits = snap.prefix_queries, snap.prefix_hits
        while True:
            await asyncio.sleep(self.config.log_interval)
            now = time.monotonic()
            tokens_per_s = (snap.generation_tokens - last_tokens) / max(now - last_time, 1e-9)
            queries = snap.prefix_queries - last_queries
            hit_rate = (snap.prefix_hits - last_hits) / queries if queries else 0.0
            busy = snap.running or snap.waiting or tokens_per_s > 0
            log = logger.info if busy else logger.debug
            log("running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, generation: %.1f "
                "tokens/s, prefix cache hit rate: %.1f%%", snap.running, snap.waiting,
                100 * snap.kv_usage, tokens_per_s, 100 * hit_rate)
            last_time, last_tokens = now, snap.generation_tokens
            last_queries, last_hits = snap.prefix_queries, snap.prefix_hits

    # ---- request checks ---------------------------------------------------------------------------

    def check_accepting(self) -> None:
        if self.draining:
            raise _server_error("the server is shutting down", 503, "shutting_down")
        if self.engine.is_dead:
            raise _server_error("the engine failed; the server takes no new requests", 503,
                                "engine_error")

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise p.RequestError(f"The model `{model[:100]}` does not exist; this server "
                                 f"serves `{self.model_name}`", param="model", status=404,
                                 code="model_not_found")

    def log_ignored(self, request: p.OpenAIModel) -> None:
        names = p.ignored_fields(request)
        if names:
            shown = [name[:40] for name in names[:10]]
            logger.warning("ignoring unknown request fields: %s", ", ".join(shown))

    def resolve_max_tokens(self, request: p.SamplingRequest, prompt_len: int, default: Optional[int],
                           prompt_field: str) -> int:
        context = self.llm.max_model_len
        if prompt_len >= context:
            raise p.RequestError(f"the prompt has {prompt_len} tokens, but the context length is "
                                 f"{context}: it must be shorter", param=prompt_field)
        field = request._max_tokens_field()
        requested = request.requested_max_tokens()
        if requested is None:
            requested = default if default is not None else context - prompt_len
        if prompt_len + requested > context:
            raise p.RequestError(f"the prompt ({prompt_len} tokens) plus {field} ({requested}) is "
                                 f"{prompt_len + requested} tokens, over the context length of "
                                 f"{context}", param=field)
        return requested

    def sampling_params(self, request: p.SamplingRequest, max_tokens: int,
                        prompt_logprobs: Optional[int]) -> SamplingParams:
        try:
            return request.sampling_params(max_tokens, prompt_logprobs)
        except ValueError as exc:
            param = _param_for_engine_error(str(exc), request._max_tokens_field())
            if param == "logprobs" and isinstance(request, p.ChatCompletionRequest):
                param = "top_logprobs"
            raise p.RequestError(str(exc), param=param) from None

    def check_reservation(self, requests: list[GenerateRequest], max_tokens_field: str) -> None:
        """A request that could never be admitted is the client's error (400), not a 429."""
        if len(requests) > self.config.max_queued_requests:
            raise p.RequestError(f"the request has {len(requests)} prompts, more than the server's "
                                 f"queue of {self.config.max_queued_requests}", param="prompt")
        reserved = sum(r.reserved_tokens for r in requests)
        cap = self.max_tokens_in_flight
        if cap and reserved > cap:
            raise p.RequestError(f"the request may need {reserved} tokens (prompt + n x "
                                 f"{max_tokens_field}), more than the server's limit of {cap} "
                                 f"tokens in flight; lower {max_tokens_field} or n",
                                 param=max_tokens_field)

    # ---- prompts -----------------------------------------------------------------------------------

    def _require_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise p.RequestError("this model has no tokenizer (dummy weights): send token ids",
                                 param=param)

    async def completion_prompts(self, request: p.CompletionRequest) -> list[PreparedPrompt]:
        prepared = []
        for prompt in request.prompts():
            if isinstance(prompt, str):
                self._require_tokenizer("prompt")
                ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
                if not ids:
                    raise p.RequestError("the prompt encodes to no tokens", param="prompt")
                prepared.append(PreparedPrompt(prompt, ids))
            else:
                prepared.append(PreparedPrompt(None, list(prompt)))
        return prepared

    async def chat_prompt(self, request: p.ChatCompletionRequest) -> PreparedPrompt:
        self._require_tokenizer("messages")
        conversation = request.conversation()
        add_generation_prompt = request.add_generation_prompt is not False
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, conversation,
                                           add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - ValueError and jinja2's TemplateError (incl. SecurityError)
            if not isinstance(exc, ValueError) and "jinja2" not in type(exc).__module__:
                raise
            raise p.RequestError(f"cannot apply the chat template: {exc}", param="messages") from None
        ids = await asyncio.to_thread(self.tokenizer.encode, text, False)
        return PreparedPrompt(text, ids)

    # ---- admission ---------------------------------------------------------------------------------

    async def submit(self, base_id: str, prompts: list[PreparedPrompt], request: p.SamplingRequest,
                     arrival: float, default_max_tokens: Optional[int], prompt_field: str,
                     prompt_logprobs: Optional[int] = None) -> Generation:
        self.check_accepting()  # a drain may have begun while the prompt was tokenized
        requests = []
        for index, prompt in enumerate(prompts):
            max_tokens = self.resolve_max_tokens(request, len(prompt.token_ids), default_max_tokens,
                                                 prompt_field)
            params = self.sampling_params(request, max_tokens, prompt_logprobs)
            requests.append(GenerateRequest(f"{base_id}-{index}", prompt.token_ids, params,
                                            request.cache_salt, arrival))
        field = request._max_tokens_field()
        self.check_reservation(requests, field)
        deadline = None
        if self.config.request_timeout > 0:
            deadline = arrival + self.config.request_timeout
        streams = await self._admit(requests, deadline, field)
        return Generation(self, streams, deadline)

    async def _admit(self, requests: list[GenerateRequest], deadline: Optional[float],
                     max_tokens_field: str) -> list[RequestStream]:
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            return await asyncio.wait_for(self.engine.generate(requests), timeout)
        except AdmissionRejected as exc:
            raise p.RequestError(str(exc), status=exc.status, err_type="rate_limit_error",
                                 code="overloaded",
                                 headers={"Retry-After": str(exc.retry_after_s)}) from None
        except ValueError as exc:
            raise p.RequestError(str(exc), param=_param_for_engine_error(str(exc), max_tokens_field)
                                 ) from None
        except EngineDeadError as exc:
            raise _server_error(str(exc), 503, "engine_error") from None
        except asyncio.TimeoutError:
            raise _server_error("the request timed out waiting for admission", 504,
                                "timeout") from None


# ---- completions ---------------------------------------------------------------------------------------


async def answer(raw: Request, generation: "Generation", stream: bool, events, build) -> Response:
    """The HTTP answer of a submitted generation: an SSE stream of events(generation), or the
    JSON of build(final outputs) once all are done; a client gone before then gets nothing."""
    if stream:
        return EngineStreamingResponse(events(generation), on_close=generation.close)
    try:
        finals = await run_unless_disconnected(raw, generation.finals())
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error answer
        raise generation_error(exc) from None
    finally:
        generation.close()
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(build(finals).model_dump())


class CompletionHandler:
    def __init__(self, state: ServerState, request: p.CompletionRequest, arrival: float):
        self.state = state
        self.request = request
        self.arrival = arrival
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = request.num_samples
        self.num_top = request.logprobs
        self.prompts: list[PreparedPrompt] = []

    async def __call__(self, raw: Request) -> Response:
        state, request = self.state, self.request
        self.prompts = await state.completion_prompts(request)
        # echo with logprobs also scores the prompt, as OpenAI's API does.
        prompt_logprobs = self.num_top if request.echo and self.num_top is not None else None
        generation = await state.submit(self.id, self.prompts, request, self.arrival,
                                        p.CompletionRequest.DEFAULT_MAX_TOKENS, "prompt",
                                        prompt_logprobs)
        return await answer(raw, generation, request.stream, self.events,
                            lambda finals: self.response(finals, generation.usage()))

    def prompt_text(self, prompt: PreparedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        if self.state.tokenizer is None:
            return ""
        return self.state.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def _echo_logprobs(self, index: int, out: RequestOutput) -> Optional[p.CompletionLogprobs]:
        prompt = self.prompts[index]
        entries = out.prompt_logprobs or [None] * len(prompt.token_ids)
        return self.state.logprobs.completion(prompt.token_ids, entries, self.num_top)

    def _choice(self, index: int, out: RequestOutput, sample) -> p.CompletionChoice:
        text, logprobs = sample.text, None
        if self.num_top is not None:
            logprobs = self.state.logprobs.completion(sample.token_ids, sample.logprobs or [],
                                                      self.num_top)
        if self.request.echo:
            prompt_text = self.prompt_text(self.prompts[index])
            if logprobs is not None:
                logprobs = _join_logprobs(self._echo_logprobs(index, out), logprobs)
            text = prompt_text + text
        return p.CompletionChoice(index=index * self.n + sample.index, text=text, logprobs=logprobs,
                                  finish_reason=sample.finish_reason)

    def response(self, finals: list[RequestOutput], usage: p.UsageInfo) -> p.CompletionResponse:
        choices = [self._choice(index, out, sample)
                   for index, out in enumerate(finals) for sample in out.outputs]
        return p.CompletionResponse(id=self.id, created=self.created, model=self.state.model_name,
                                    choices=choices, usage=usage)

    def _chunk(self, choices: list[p.CompletionChoice], usage=None) -> str:
        chunk = p.CompletionChunk(id=self.id, created=self.created, model=self.state.model_name,
                                  choices=choices, usage=usage)
        return sse(chunk.model_dump_json())

    def _stream_choice(self, index: int, out: RequestOutput, position: int,
                       first: bool) -> Optional[p.CompletionChoice]:
        sample = out.outputs[position]
        text = out.delta_text[position] if position < len(out.delta_text) else ""
        new_ids = out.delta_token_ids[position] if position < len(out.delta_token_ids) else []
        logprobs = None
        if self.num_top is not None:
            logprobs = self.state.logprobs.completion(new_ids, _new_entries(sample, len(new_ids)),
                                                      self.num_top)
        if first and self.request.echo:
            if logprobs is not None:
                logprobs = _join_logprobs(self._echo_logprobs(index, out), logprobs)
            text = self.prompt_text(self.prompts[index]) + text
        if not text and not sample.finish_reason and not (logprobs and logprobs.tokens):
            return None
        return p.CompletionChoice(index=index * self.n + sample.index, text=text, logprobs=logprobs,
                                  finish_reason=sample.finish_reason)

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        started: set[int] = set()
        try:
            async for index, out in generation.outputs():
                choices = []
                for position, sample in enumerate(out.outputs):
                    choice_index = index * self.n + sample.index
                    first = choice_index not in started
                    choice = self._stream_choice(index, out, position, first)
                    if choice is not None:
                        started.add(choice_index)
                        choices.append(choice)
                if choices:
                    yield self._chunk(choices)
            if self.request.include_usage_in_stream:
                yield self._chunk([], usage=generation.usage())
        except Exception as exc:  # noqa: BLE001 - the status line is sent; errors go in the stream
            yield sse_error(generation_error(exc))
        yield SSE_DONE


def _join_logprobs(prompt: p.CompletionLogprobs, output: p.CompletionLogprobs) -> p.CompletionLogprobs:
    """Echoed prompt logprobs followed by the output's, with continuous text offsets."""
    shift = sum(len(token) for token in prompt.tokens)
    return p.CompletionLogprobs(
        tokens=prompt.tokens + output.tokens,
        token_logprobs=prompt.token_logprobs + output.token_logprobs,
        top_logprobs=prompt.top_logprobs + output.top_logprobs,
        text_offset=prompt.text_offset + [offset + shift for offset in output.text_offset])


# ---- chat completions -------------------------------------------------------------------------------


class ChatHandler:
    def __init__(self, state: ServerState, request: p.ChatCompletionRequest, arrival: float):
        self.state = state
        self.request = request
        self.arrival = arrival
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.num_top = request.num_logprobs()

    async def __call__(self, raw: Request) -> Response:
        state, request = self.state, self.request
        prompt = await state.chat_prompt(request)
        generation = await state.submit(self.id, [prompt], request, self.arrival, None, "messages")
        return await answer(raw, generation, request.stream, self.events,
                            lambda finals: self.response(finals[0], generation.usage()))

    def _logprobs(self, token_ids: list[int], entries: list[Optional[dict]]) -> Optional[p.ChatLogprobs]:
        if self.num_top is None:
            return None
        return self.state.logprobs.chat(token_ids, entries, self.num_top)

    def response(self, out: RequestOutput, usage: p.UsageInfo) -> p.ChatCompletionResponse:
        choices = []
        for sample in out.outputs:
            logprobs = self._logprobs(sample.token_ids, sample.logprobs or [])
            choices.append(p.ChatChoice(index=sample.index,
                                        message=p.ChatResponseMessage(content=sample.text),
                                        logprobs=logprobs, finish_reason=sample.finish_reason))
        return p.ChatCompletionResponse(id=self.id, created=self.created,
                                        model=self.state.model_name, choices=choices, usage=usage)

    def _chunk(self, choices: list[p.ChatStreamChoice], usage=None) -> str:
        chunk = p.ChatCompletionChunk(id=self.id, created=self.created, model=self.state.model_name,
                                      choices=choices, usage=usage)
        return sse(chunk.model_dump_json())

    def _stream_choice(self, out: RequestOutput, position: int) -> Optional[p.ChatStreamChoice]:
        sample = out.outputs[position]
        text = out.delta_text[position] if position < len(out.delta_text) else ""
        new_ids = out.delta_token_ids[position] if position < len(out.delta_token_ids) else []
        logprobs = self._logprobs(new_ids, _new_entries(sample, len(new_ids)))
        if not text and not sample.finish_reason and not (logprobs and logprobs.content):
            return None
        delta = p.ChatDelta(content=text) if text else p.ChatDelta()
        return p.ChatStreamChoice(index=sample.index, delta=delta, logprobs=logprobs,
                                  finish_reason=sample.finish_reason)

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        # The role comes first, once per choice, as OpenAI sends it.
        roles = [p.ChatStreamChoice(index=i, delta=p.ChatDelta(role="assistant", content=""))
                 for i in range(self.request.num_samples)]
        yield self._chunk(roles)
        try:
            async for _, out in generation.outputs():
                choices = []
                for position in range(len(out.outputs)):
                    choice = self._stream_choice(out, position)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield self._chunk(choices)
            if self.request.include_usage_in_stream:
                yield self._chunk([], usage=generation.usage())
        except Exception as exc:  # noqa: BLE001 - the status line is sent; errors go in the stream
            yield sse_error(generation_error(exc))
        yield SSE_DONE


# ---- reading the body ---------------------------------------------------------------------------------


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object, or a RequestError (400, 413, 415) saying what is wrong."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise p.RequestError("Content-Type must be application/json", status=415)
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise p.RequestError(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise p.RequestError("the request body is nested too deeply") from None
    except ValueError as exc:
        raise p.RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise p.RequestError(f"the request body must be a JSON object, got {type(value).__name__}")
    return value


def _too_large(max_bytes: int) -> p.RequestError:
    return p.RequestError(f"the request body is larger than the server's limit of {max_bytes} bytes",
                          status=413, code="request_too_large")


# ---- the app -----------------------------------------------------------------------------------------------


def create_app(engine_kwargs: Optional[dict] = None, config: Optional[ServerConfig] = None,
               engine=None) -> FastAPI:
    """The FastAPI app serving one model.

    engine_kwargs: LLMEngine options (model=None is the default model), or give
    an already built LLMEngine as `engine`. The engine's thread starts with the
    app's lifespan; state lives at app.state.rooflm (a ServerState).
    """
    config = config or ServerConfig()
    engine_kwargs = dict(engine_kwargs or {})
    if engine is None:
        from rooflm.engine.llm_engine import LLMEngine
        engine = LLMEngine.from_kwargs(**engine_kwargs)
    model_name = config.served_model_name or derive_model_name(engine_kwargs.get("model"),
                                                               engine.model_path)
    state = ServerState(config, engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="rooflm", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.rooflm = state
    _add_error_handlers(app)
    _add_routes(app, state)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(HeaderLimitMiddleware, max_header_bytes=config.max_header_bytes)
    if config.allowed_origins:
        # Added last, so it runs first: preflights and 401s carry CORS headers.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(p.RequestError)
    async def on_request_error(_: Request, exc: p.RequestError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError):
        # OpenAI answers 400 where FastAPI would answer 422.
        errors = exc.errors()
        first = errors[0] if errors else {}
        path = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        return error_response(p.RequestError(f"{path}: {first.get('msg', 'invalid request')}",
                                             param=path or None))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException):
        error = p.RequestError(str(exc.detail), status=exc.status_code,
                               code="not_found" if exc.status_code == 404 else None,
                               headers=dict(exc.headers or {}))
        return error_response(error)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception):
        logger.exception("unhandled error in a request handler")
        return error_response(_server_error(f"internal error: {type(exc).__name__}", 500,
                                            "internal_error"))


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        reason = state.engine.health(state.config.health_stall_seconds)
        if reason is not None:
            return error_response(_server_error(reason, 503, "unhealthy"))
        return JSONResponse({})

    @app.get("/ready")
    async def ready():
        if state.draining:
            return error_response(_server_error("the server is shutting down", 503, "not_ready"))
        if not state.ready or state.engine.is_dead:
            return error_response(_server_error("the server is not ready", 503, "not_ready"))
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=None,
                        headers={"Content-Type": state.metrics.content_type})

    @app.get("/v1/models")
    async def list_models():
        card = p.ModelCard(id=state.model_name, max_model_len=state.llm.max_model_len)
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        state.check_model(model_id)
        card = p.ModelCard(id=state.model_name, max_model_len=state.llm.max_model_len)
        return JSONResponse(card.model_dump())

    @app.post("/v1/completions")
    async def create_completion(raw: Request):
        arrival = time.monotonic()
        request = await _parse(raw, state, p.CompletionRequest)
        return await CompletionHandler(state, request, arrival)(raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request):
        arrival = time.monotonic()
        request = await _parse(raw, state, p.ChatCompletionRequest)
        return await ChatHandler(state, request, arrival)(raw)


async def _parse(raw: Request, state: ServerState, model: type[p.SamplingRequest]):
    state.check_accepting()
    body = await _read_body_in_time(raw, state.config)
    request = p.validate_request(model, body)
    state.check_model(request.model)
    request.check(state.limits)
    state.log_ignored(request)
    return request


async def _read_body_in_time(raw: Request, config: ServerConfig) -> dict:
    """A client that sends its body slowly (or never) must not hold a handler forever."""
    if config.request_timeout <= 0:
        return await read_json_body(raw, config.max_body_bytes)
    try:
        return await asyncio.wait_for(read_json_body(raw, config.max_body_bytes),
                                      config.request_timeout)
    except asyncio.TimeoutError:
        raise p.RequestError("the request body did not arrive within the request timeout",
                             status=408, code="timeout") from None
