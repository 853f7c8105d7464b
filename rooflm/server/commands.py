"""`rooflm serve`: the OpenAI-compatible server, FastAPI on uvicorn.

`rooflm serve` with no flags serves the default model (SmolLM2-135M-Instruct)
on http://127.0.0.1:8000. Every engine flag of `rooflm generate` works here.
The engine runs in a process of its own (rooflm/engine/core.py);
--no-engine-process keeps it on a thread of the server's process.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import sys

import rooflm.envs as envs
from rooflm.dp.router import POLICIES
from rooflm.engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)

API_KEY_ENV = "ROOFLM_API_KEY"

# The limit on a request's head (request line + headers): the app answers 431
# past it, and uvicorn's h11 drops a head still incomplete past it.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible API (completions, chat, models, metrics)",
        description=__doc__.splitlines()[0])
    # vLLM's habit: `serve MODEL`; --model (an engine flag) still works.
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a model directory, .gguf file or (with --load-format dummy) preset; "
                             "the same as --model (default: the embedded SmolLM2-135M-Instruct)")
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: derived from the model path)")
    group.add_argument("--api-key", default=None,
                       help=f"require Authorization: Bearer <key> (default: ${API_KEY_ENV}; the "
                            f"environment keeps the key out of the process list)")
    group.add_argument("--allowed-origins", default=None,
                       help="comma-separated origins allowed by CORS (default: CORS off)")
    group.add_argument("--max-queued-requests", type=int, default=64,
                       help="waiting requests past which new ones get 429 (default: 64)")
    group.add_argument("--max-tokens-in-flight", type=int, default=None,
                       help="cap on prompt + n * max_tokens summed over admitted requests; past it "
                            "429 (default: 8 x the KV cache's tokens; 0: no cap)")
    group.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    group.add_argument("--max-body-bytes", type=int, default=1 << 20,
                       help="larger request bodies get 413 (default: 1 MiB)")
    group.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                       help="larger request heads (line + headers) get 431 (default: 16 KiB)")
    group.add_argument("--ttft-slo-ms", type=float, default=0.0,
                       help="time-to-first-token budget in ms: a request whose predicted time to "
                            "first token (from the engine's measured step costs) already exceeds it gets "
                            "503 with Retry-After before any prefill; a request's deadline_ms "
                            "overrides it (default: 0, no budget)")
    group.add_argument("--request-timeout", type=float, default=600.0,
                       help="seconds before a request is aborted (default: 600; 0: never)")
    group.add_argument("--header-timeout-s", type=float, default=60.0,
                       help="a request head (line + headers) not complete this many seconds after "
                            "its first byte gets 408 and its connection closed (default: 60, as "
                            "nginx; 0: none)")
    group.add_argument("--body-timeout-s", type=float, default=60.0,
                       help="a request body not complete this many seconds after its head gets "
                            "408 and its connection closed (default: 60, as nginx; 0: none)")
    group.add_argument("--max-reading-connections", type=int, default=256,
                       help="request heads (and, apart, bodies) still arriving at once; past it "
                            "new connections (slow bodies) get 503 at once, admitted requests are "
                            "untouched (default: 256)")
    group.add_argument("--health-stall-seconds", type=float, default=30.0,
                       help="/health fails when the engine loop makes no progress this long")
    group.add_argument("--engine-restart", action=argparse.BooleanOptionalAction, default=True,
                       help="restart an engine core that dies, with the same configuration: "
                            "requests that had streamed tokens fail, queued ones run on the new "
                            "core (default: on; --no-engine-restart: the server fails as a whole)")
    group.add_argument("--engine-restart-max-deaths", type=int, default=5,
                       help="crash-loop guard: a core that dies this many times within "
                            "--engine-restart-window-s stays down (default: 5)")
    group.add_argument("--engine-restart-window-s", type=float, default=60.0,
                       help="the crash-loop guard's window in seconds (default: 60)")
    group.add_argument("--keep-running-on-error", action="store_true",
                       help="after an engine failure stay up (unhealthy) instead of exiting with 1")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds in-flight requests get to finish (default: 30)")
    group.add_argument("--log-interval", type=float, default=10.0,
                       help="seconds between stats log lines (default: 10; 0: off)")
    group.add_argument("--peak-bandwidth-gbs", type=float, default=0.0,
                       help="device memory bandwidth in GB/s for MBU (the rooflm:mbu gauge and "
                            "the log line); 0: the GPU table's, if it knows the device")
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine loop in a process of its own, so HTTP, tokenization "
                            "and SSE never hold up a step (default: on); --no-engine-process "
                            "runs it on a thread of the server's process")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine cores behind this server, each on its own GPU or tensor-"
                            "parallel group (rooflm/dp/); needs the engine process")
    group.add_argument("--dp-routing", default="cache_aware", choices=POLICIES,
                       help="how a request picks its data-parallel replica")
    group.add_argument("--data-parallel-backend", default="mp", choices=("mp", "ray"),
                       help="where the replicas run: mp, processes of this host; ray, actors on "
                            "the nodes of a Ray cluster (pip install 'rooflm[ray]')")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template replacing the model's: a file path, or the "
                            "template itself (checked at start-up)")
    group.add_argument("--split-special-tokens", action="store_true",
                       help="treat special tokens typed in chat message content as plain text "
                            "(default: they are parsed as special tokens, as in vLLM; a request's "
                            "split_special_tokens field overrides)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="no access log line per request (method, path, status, latency, "
                            "tokens; default: one line as each response ends)")
    group.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served under these model names "
                            "(needs --enable-lora)")
    group.add_argument("--cpu-threads", type=int, default=None,
                       help="a CPU engine core's torch threads, pinned (default: chosen for the "
                            "machine: fewer than its cores, with a passive OpenMP wait, when the "
                            "load average says other work runs; ROOFLM_CPU_CONTENTION=off: torch's)")
    group.add_argument("--uvicorn-log-level", default="warning")
    add_engine_args(parser)
    parser.set_defaults(func=cmd_serve)


def server_config(args: argparse.Namespace):
    from rooflm.server.chat_template import load_chat_template
    from rooflm.server.config import ServerConfig
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    return ServerConfig(
        served_model_name=args.served_model_name,
        api_key=args.api_key or envs.get(API_KEY_ENV) or None,
        allowed_origins=origins,
        max_queued_requests=args.max_queued_requests,
        max_tokens_in_flight=args.max_tokens_in_flight,
        max_n=args.max_n,
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
        request_timeout=args.request_timeout,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_reading_connections=args.max_reading_connections,
        health_stall_seconds=args.health_stall_seconds,
        engine_restart=args.engine_restart,
        engine_restart_max_deaths=args.engine_restart_max_deaths,
        engine_restart_window_s=args.engine_restart_window_s,
        keep_running_on_error=args.keep_running_on_error,
        shutdown_timeout=args.shutdown_timeout,
        log_interval=args.log_interval,
        peak_bandwidth_gbs=args.peak_bandwidth_gbs,
        chat_template=None if args.chat_template is None else load_chat_template(args.chat_template),
        split_special_tokens=args.split_special_tokens,
        log_requests=not args.disable_log_requests,
        data_parallel_size=args.data_parallel_size,
        dp_routing=args.dp_routing,
        data_parallel_backend=args.data_parallel_backend,
        ttft_slo_ms=args.ttft_slo_ms,
        lora_modules=tuple(args.lora_modules or ()),
    )


def _make_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn whose first SIGTERM/SIGINT drains instead of stopping at once.

        The drain (ServerState.drain_and_exit) refuses new requests with 503,
        gives in-flight ones shutdown_timeout seconds, aborts the rest, then
        asks us to exit. A second signal stops now. The signal is not re-raised
        after a drain, so a clean drain exits with status 0.
        """

        def __init__(self, config, state):
            super().__init__(config)
            self.state = state
            self._drain_requested = False

        def handle_exit(self, sig, frame) -> None:
            loop = self.state.loop
            if self._drain_requested or loop is None:
                self.force_exit = self.should_exit and sig == signal.SIGINT
                self.should_exit = True
                return
            self._drain_requested = True
            loop.call_soon_threadsafe(self.state.begin_drain)

        def request_exit(self) -> None:
            self.should_exit = True

    return GracefulServer


def _show_server_logs() -> None:
    """Start-up progress (weights, KV cache, graphs, "ready in"), the access log and the
    periodic stats line are rooflm's INFO lines; show them by default, as vLLM does. Other
    libraries stay at the root level (--log-level). The engine core process takes the
    "rooflm" logger's level with it (engine/core_process.py)."""
    rooflm_logger = logging.getLogger("rooflm")
    if rooflm_logger.getEffectiveLevel() > logging.INFO:
        rooflm_logger.setLevel(logging.INFO)


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of host:port, as uvicorn would bind them, but before the
    model loads: a port in use is reported in a moment, not after the load. Not listening yet, so
    a client during the load is refused as before; uvicorn listens on them once the app is up.

    Raises OSError naming host:port. Python's sockets are not inherited, so the engine's spawned
    processes do not hold the port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # What asyncio's create_server sets: a restart may bind over connections in TIME_WAIT;
            # an IPv6 socket leaves IPv4 to its own socket.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        hint = " (another server? pick another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sockets


def cmd_serve(args: argparse.Namespace) -> int:
    from rooflm.server.chat_template import ChatTemplateError

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            print(f"rooflm: error: two models given: {args.model_tag!r} and --model {args.model!r}",
                  file=sys.stderr)
            return 2
        args.model = args.model_tag
    try:
        config = server_config(args)  # before the model loads: a bad template fails fast
    except ChatTemplateError as exc:
        print(f"rooflm: error: --chat-template: {exc}", file=sys.stderr)
        return 1
    try:
        listeners = bind_listeners(args.host, args.port)
    except OSError as exc:
        print(f"rooflm: error: {exc}", file=sys.stderr)
        return 1
    try:
        return _serve_on(args, config, listeners)
    finally:
        for sock in listeners:
            sock.close()


def _serve_on(args: argparse.Namespace, config, listeners: list[socket.socket]) -> int:
    """Load the model, then serve on the sockets bind_listeners bound."""
    import uvicorn

    from rooflm.server.app import create_app
    from rooflm.server.slow_clients import head_timeout_protocol
    from rooflm.server.state import FLUSH_GRACE_S

    from rooflm.engine.core_process import EngineStartError
    from rooflm.server.chat_template import ChatTemplateError

    _show_server_logs()
    if args.cpu_threads is not None:
        if args.cpu_threads < 1:
            print(f"rooflm: error: --cpu-threads must be >= 1, got {args.cpu_threads}",
                  file=sys.stderr)
            return 2
        envs.put("ROOFLM_CPU_THREADS", str(args.cpu_threads))  # the engine core reads it
    try:
        app = create_app(engine_kwargs(args), config, engine_process=args.engine_process)
    except ChatTemplateError as exc:
        print(f"rooflm: error: --chat-template: {exc}", file=sys.stderr)
        return 1
    except EngineStartError as exc:
        print(f"rooflm: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a layout the host cannot take (data parallel x GPUs)
        print(f"rooflm: error: {exc}", file=sys.stderr)
        return 2
    state = app.state.rooflm
    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, lifespan="on",
        http=head_timeout_protocol(config.header_timeout_s, state.head_gate),
        log_level=args.uvicorn_log_level, server_header=False,
        # Twice our own limit: a head arriving in pieces is buffered long enough
        # for the app to answer 431 in OpenAI's shape, and never without bound.
        h11_max_incomplete_event_size=2 * args.max_header_bytes,
        # After our own drain, only stragglers remain: do not wait long for them.
        timeout_graceful_shutdown=int(FLUSH_GRACE_S + 4))
    server = _make_server_class()(uvicorn_config, state)
    state.request_exit = server.request_exit
    logger.info("serving %s on http://%s:%d (API key %s)", state.model_name, args.host, args.port,
                "required" if config.api_key else "off")
    server.run(sockets=listeners)
    return state.exit_code
