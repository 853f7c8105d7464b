"""The OpenAI-compatible HTTP API: create_app() builds the FastAPI app around one engine.

A request's path through the server:
  1. middleware.py: the API key (Authorization: Bearer, constant-time compare)
     and the head's size, then CORS when origins are allowed;
  2. refuse early (503) while shutting down or after the engine died;
  3. body.py reads the body (at most max_body_bytes, else 413), strict UTF-8
     and JSON; protocol.py validates it (a type error is a 400, never a 422)
     and checks every range (400); the model name must be ours (404);
  4. prompts.py renders the chat template and tokenizes, in a worker thread;
  5. admission.py resolves max_tokens against the context length, builds
     SamplingParams and hands the prompts to the front end (engine/client.py's
     EngineClient: in-process, engine-core client or DP client), which admits
     them all or refuses (429 with Retry-After when the queue or the tokens in
     flight are full). Whatever the engine or SamplingParams refuse arrives as
     InvalidRequest, a 400 whose param is the field as the client sent it;
  6. completions.py / chat.py answer: Server-Sent Events (streaming.py), or
     one JSON body at the end. A client that disconnects, or a request that
     runs past request_timeout, aborts its engine requests (generation.py),
     which frees their KV blocks at the engine's next step.

Every response carries X-Request-Id (request_id.py): the client's, or a new one.
Besides the OpenAI routes: /tokenize, /detokenize, /tokenizer_info, /version (tokenize.py, vLLM's
shapes), /v1/responses (responses.py) and /docs (FastAPI's page over /openapi.json).
Each request ends with one access log line (access_log.py) unless --disable-log-requests. Any other path is a 404 in OpenAI's
error shape naming the endpoint as unsupported; a wrong method is a 405.

Health: /health is 200 while the engine loop is alive and making progress;
/ready is 200 once a warm-up generation has run, until shutdown begins. An
engine core that dies is restarted (--engine-restart, the default): both answer
503 only while the new core starts; requests that had streamed tokens fail,
the others are run on the new core (engine/core_client.py).

Sleep mode (vLLM's endpoints, with --enable-sleep-mode; without it they answer 404
naming the flag): POST /sleep?level=1|2 aborts what runs and frees the device (the
KV pool; the weights moved to host memory or dropped), POST /wake_up restores it,
GET /is_sleeping answers {"is_sleeping": bool}. While asleep, generation requests
get 503 (code "sleeping"), /ready is 503 and /health stays 200 (the process is
alive: a liveness probe must not restart it) with {"is_sleeping": true}.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import rooflm.envs as envs
from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.engine.client import EngineClientFactory
from rooflm.errors import InvalidRequest
from rooflm.server import protocol as p
from rooflm.server.body import read_body_in_time
from rooflm.server.chat import ChatHandler
from rooflm.server.chat_template import ChatTemplateError
from rooflm.server.completions import CompletionHandler
from rooflm.server.config import ServerConfig, derive_model_name
from rooflm.server.errors import error_response, server_error
from rooflm.server.access_log import AccessLogMiddleware
from rooflm.server.middleware import DOCS_PATH, OPENAPI_PATH, APIKeyMiddleware, HeaderLimitMiddleware
from rooflm.server.request_id import HEADER as REQUEST_ID_HEADER
from rooflm.server.request_id import RequestIdMiddleware, request_id
from rooflm.server.responses import create_response
from rooflm.server.slow_clients import BodyTimeoutMiddleware
from rooflm.server.tokenize import detokenize, tokenize, tokenizer_info, version
from rooflm.server.state import ServerState
from rooflm.version import __version__

logger = logging.getLogger(__name__)


def create_app(engine_kwargs: Optional[dict] = None, config: Optional[ServerConfig] = None,
               engine=None, engine_process: bool = False) -> FastAPI:
    """The FastAPI app serving one model.

    engine_kwargs: LLMEngine options (model=None is the default model), or give
    an already built LLMEngine as `engine`. engine_process: build the engine in
    a process of its own (engine/core.py; `rooflm serve`'s default) and wait
    until it is ready; else it runs on a thread of this process. The engine
    starts serving with the app's lifespan; state lives at app.state.rooflm (a
    ServerState).
    """
    config = config or ServerConfig()
    # The front end for where the engine runs: on a thread here, in a process of its own,
    # or as data-parallel replicas (each an EngineClient).
    front: EngineClientFactory = AsyncLLMEngine
    if config.data_parallel_size > 1 or config.data_parallel_backend == "ray":
        if engine is not None or not engine_process:
            raise ValueError("data_parallel_size > 1 (or --data-parallel-backend ray) runs each "
                             "replica in an engine process of its own: it needs engine_process "
                             "(drop --no-engine-process)")
        from functools import partial
        from rooflm.config import engine_config_from_kwargs
        from rooflm.dp.client import DPClient
        from rooflm.dp.replicas import ReplicaSet
        engine = ReplicaSet.launch(engine_config_from_kwargs(**(engine_kwargs or {})),
                                   config.data_parallel_size, config.data_parallel_backend)
        # On a Ray cluster a node can go away with its replica: the others keep serving.
        front = partial(DPClient, policy=config.dp_routing, restart=config.restart_policy(),
                        keep_serving=config.data_parallel_backend == "ray")
    elif engine is None and engine_process:
        from rooflm.config import engine_config_from_kwargs
        from rooflm.engine.core_client import EngineCoreClient
        from rooflm.engine.core_process import EngineCoreProcess
        from functools import partial
        engine = EngineCoreProcess.launch(engine_config_from_kwargs(**(engine_kwargs or {})))
        front = partial(EngineCoreClient, restart=config.restart_policy())
    elif engine is None:
        from rooflm.engine.llm_engine import LLMEngine
        engine = LLMEngine.from_kwargs(**(engine_kwargs or {}))
    model_name = config.served_model_name or derive_model_name(engine.info.model)
    try:
        state = ServerState(config, engine, model_name, front, _lora_config(engine, engine_kwargs))
    except (ChatTemplateError, ValueError):
        if engine_process:
            engine.close()  # the core process would otherwise outlive this failed start
        raise

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        try:
            yield
        finally:
            await state.stop()

    # /docs is FastAPI's own page (Swagger UI over /openapi.json), as vLLM serves it.
    app = FastAPI(title="rooflm", version=__version__, lifespan=lifespan,
                  docs_url=DOCS_PATH, redoc_url=None, openapi_url=OPENAPI_PATH)
    # A trailing slash is another path (404), not a 307 to a Location built from the
    # client's own Host header.
    app.router.redirect_slashes = False
    app.state.rooflm = state
    _add_error_handlers(app)
    _add_routes(app, state)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(HeaderLimitMiddleware, max_header_bytes=config.max_header_bytes)
    # Inside the id and access-log middleware, so a 408 or 503 for a slow body has both.
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=config.body_timeout_s,
                       gate=state.body_gate)
    if config.allowed_origins:
        # Added last, so it runs first: preflights and 401s carry CORS headers.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER],
                           expose_headers=[REQUEST_ID_HEADER])
    if config.log_requests:
        # Outside every check, so 401s and 431s are logged too; inside the id middleware.
        app.add_middleware(AccessLogMiddleware)
    # Added last, so it runs first: every answer, the middleware's own included, has the id.
    app.add_middleware(RequestIdMiddleware)
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
    async def on_http_error(raw: Request, exc: StarletteHTTPException):
        # Only the router raises these: a path no route serves, or a method it does not take.
        path = raw.url.path[:200]
        message, code = str(exc.detail), None
        if exc.status_code == 404:
            message, code = f"{path} is not supported by rooflm", "unsupported_endpoint"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{raw.method} is not allowed on {path}"
            if allowed:
                message += f"; use {allowed}"
            code = "method_not_allowed"
        error = p.RequestError(message, status=exc.status_code, code=code,
                               headers=dict(exc.headers or {}))
        return error_response(error)

    @app.exception_handler(Exception)
    async def on_unexpected(raw: Request, exc: Exception):
        logger.exception("request %s: unhandled error in a request handler", request_id(raw))
        return error_response(server_error(f"internal error: {type(exc).__name__}", 500,
                                           "internal_error"))


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        reason = state.engine_client.health(state.config.health_stall_seconds)
        if reason is not None:
            return error_response(server_error(reason, 503, "unhealthy"))
        if state.info.enable_sleep_mode:
            return JSONResponse({"is_sleeping": state.engine_client.is_sleeping})
        return JSONResponse({})

    @app.get("/ready")
    async def ready():
        if state.draining:
            return error_response(server_error("the server is shutting down", 503, "not_ready"))
        if not state.ready or state.engine_client.is_dead or state.engine_client.is_restarting:
            return error_response(server_error("the server is not ready", 503, "not_ready"))
        if state.engine_client.is_sleeping:
            return error_response(server_error("the engine is sleeping", 503, "sleeping"))
        return JSONResponse({"status": "ready"})

    @app.post("/sleep")
    async def sleep(raw: Request):
        _check_sleep_mode(state, raw)
        level = _sleep_level(raw.query_params.get("level", "1"))
        try:
            await state.engine_client.sleep(level)
        except InvalidRequest as exc:
            raise p.RequestError(str(exc), param=exc.param) from None
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        _check_sleep_mode(state, raw)
        phases = await state.engine_client.wake_up()
        # vLLM answers an empty 200; the body here says where the wake-up's time went.
        return JSONResponse({"phases": phases}) if phases else Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping(raw: Request):
        _check_sleep_mode(state, raw)
        return JSONResponse({"is_sleeping": state.engine_client.is_sleeping})

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=None,
                        headers={"Content-Type": state.metrics.content_type})

    def model_card(lora=None) -> p.ModelCard:
        if lora is None:
            return p.ModelCard(id=state.model_name, max_model_len=state.info.max_model_len, root=state.model_name)
        return p.ModelCard(id=lora.lora_name, max_model_len=state.info.max_model_len, root=lora.lora_path,
                           parent=state.model_name)

    @app.get("/v1/models")
    async def list_models():
        cards = [model_card()] + [model_card(lora) for lora in state.loras.adapters.values()]
        return JSONResponse(p.ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        return JSONResponse(model_card(state.lora_of(model_id)).model_dump())

    if envs.get("ROOFLM_ALLOW_RUNTIME_LORA_UPDATING"):
        # vLLM's runtime adapter endpoints, behind the same kind of switch: anyone who can reach
        # the server could otherwise make it read any directory.
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw: Request):
            body = await _read_json(raw, state)
            name, path = _lora_fields(body, ("lora_name", "lora_path"))
            state.loras.add(name, path)
            logger.info("LoRA adapter %r loaded from %s", name, path)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request):
            body = await _read_json(raw, state)
            (name,) = _lora_fields(body, ("lora_name",))
            state.loras.remove(name)
            logger.info("LoRA adapter %r unloaded", name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/version")
    async def get_version():
        return JSONResponse(version().model_dump())

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return JSONResponse(tokenizer_info(state))

    @app.post("/tokenize")
    async def post_tokenize(raw: Request):
        body = await _read_json(raw, state)
        return JSONResponse((await tokenize(state, body)).model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def post_detokenize(raw: Request):
        body = await _read_json(raw, state)
        return JSONResponse((await detokenize(state, body)).model_dump())

    @app.post("/v1/responses")
    async def post_response(raw: Request):
        arrival = time.monotonic()
        body = await _read_json(raw, state)
        return await create_response(state, raw, body, arrival)

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


def _check_sleep_mode(state: ServerState, raw: Request) -> None:
    if not state.info.enable_sleep_mode:
        raise p.RequestError(f"{raw.url.path} needs sleep mode: start the server with "
                             f"--enable-sleep-mode", status=404, code="sleep_mode_disabled")
    state.check_accepting()


def _sleep_level(text: str) -> int:
    try:
        level = int(text)
    except ValueError:
        level = None
    if level not in (1, 2):
        raise p.RequestError(f"level must be 1 or 2, got {text[:20]!r}", param="level")
    return level


def _lora_config(engine, engine_kwargs: Optional[dict]):
    """The engine's LoRAConfig: an engine built here or given keeps its EngineConfig; an engine
    process or DP replicas were built from engine_kwargs."""
    config = getattr(engine, "config", None)
    if config is not None and hasattr(config, "lora"):
        return config.lora
    from rooflm.config import engine_config_from_kwargs
    return engine_config_from_kwargs(**(engine_kwargs or {})).lora


def _lora_fields(body: dict, names: tuple[str, ...]) -> list[str]:
    values = []
    for name in names:
        value = body.get(name) if isinstance(body, dict) else None
        if not isinstance(value, str) or not value:
            raise p.RequestError(f"{name} must be a non-empty string", param=name)
        values.append(value)
    return values


async def _read_json(raw: Request, state: ServerState) -> dict:
    state.check_accepting()
    return await read_body_in_time(raw, state.config.max_body_bytes, state.config.request_timeout)


async def _parse(raw: Request, state: ServerState, model: type[p.SamplingRequest]):
    body = await _read_json(raw, state)
    request = p.validate_request(model, body)
    state.check_model(request.model)
    request.check(state.limits)
    state.log_ignored(request, request_id(raw))
    return request
