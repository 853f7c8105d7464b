"""What the handlers share (app.state.rooflm), and the server's life: start, warm-up, drain, failure.

Requests reach the engine only through the front-end protocol, an EngineClient
(engine/client.py), whichever front end create_app built. Besides, the server
reads the engine's face: `engine.info` (fixed at start-up), `engine.tokenizer`,
and the StepReports it hands observers; the EngineSnapshot comes from the
front end. Nothing here touches the scheduler, the block manager or the runner.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Callable, Optional

from prometheus_client import Gauge

from rooflm.engine.client import EngineClient, EngineClientFactory
from rooflm.engine.host_gc import tune_gc_for_serving
from rooflm.engine.request_types import AdmissionLimits, GenerateRequest
from rooflm.server.lora import LoRARegistry, parse_lora_modules
from rooflm.sampling_params import SamplingParams
from rooflm.server import protocol as p
from rooflm.server.chat_template import install_chat_template
from rooflm.server.config import ServerConfig
from rooflm.server.errors import server_error
from rooflm.server.logprobs import LogprobFormatter
from rooflm.server.metrics import ServerMetrics
from rooflm.server.slow_clients import ReadingGate
from rooflm.server.stats import attach_step_meter, log_stats_forever

logger = logging.getLogger(__name__)

# How long error answers get to reach their clients before an engine failure
# or a shutdown ends the process.
FLUSH_GRACE_S = 1.0


class ServerState:
    """Everything the handlers share; lives at app.state.rooflm.

    engine: the engine's face (info, tokenizer, observers; for data parallelism, its
    replicas); engine_client: the front end built by `front(engine, limits,
    metrics)`, which owns the engine from start() on and through which every
    request goes.
    """

    def __init__(self, config: ServerConfig, engine, model_name: str, front: EngineClientFactory,
                 lora_config=None):
        self.config = config
        self.engine = engine
        self.info = engine.info
        self.model_name = model_name
        # The LoRA adapters served beside the base model (server/lora.py); lora_config: the
        # engine's LoRAConfig (None: LoRA off). --lora-modules are checked here, at start-up.
        self.loras = LoRARegistry(lora_config, model_name)
        for name, path in parse_lora_modules(config.lora_modules):
            try:
                self.loras.add(name, path)
            except p.RequestError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e.message}") from e
        self.tokenizer = engine.tokenizer
        if config.chat_template is not None:
            install_chat_template(self.tokenizer, config.chat_template)
        self.metrics = ServerMetrics(model_name, max_model_len=self.info.max_model_len)
        self.meter = attach_step_meter(engine, self.metrics, config.peak_bandwidth_gbs)
        self.max_tokens_in_flight = config.tokens_in_flight_cap(self.info.kv_capacity_tokens)
        limits = AdmissionLimits(config.max_queued_requests, self.max_tokens_in_flight,
                                 config.ttft_slo_ms)
        self.engine_client: EngineClient = front(engine, limits, self.metrics)
        self.limits = p.RequestLimits(max_n=config.max_n, vocab_size=self.info.model_config.vocab_size,
                                      max_model_len=self.info.max_model_len)
        self.logprobs = LogprobFormatter(self.tokenizer)
        # Heads (uvicorn's protocol) and bodies (the app's middleware) still arriving, each
        # bounded on its own: slow bodies never crowd out a fast request's head.
        self.head_gate = ReadingGate(config.max_reading_connections)
        self.body_gate = ReadingGate(config.max_reading_connections)
        for gate, name, what in ((self.head_gate, "rooflm:reading_heads", "request heads"),
                                 (self.body_gate, "rooflm:reading_bodies", "request bodies")):
            Gauge(name, f"Connections whose {what} are still arriving.",
                  registry=self.metrics.registry).set_function(lambda gate=gate: gate.reading)
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
        self.engine_client.start(on_dead=self.on_engine_dead)
        if self.config.warmup:
            self._spawn(self.warm_up())
        else:
            self.ready = True
        if self.config.log_interval > 0:
            self._spawn(log_stats_forever(self.engine_client, self.meter, self.config.log_interval))

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.engine_client.shutdown()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def warm_up(self) -> None:
        """One tiny generation per engine core (data-parallel replicas: the router spreads
        them by load): the first step pays one-time costs, not a client."""
        try:
            await asyncio.gather(*(self._warm_up_one() for _ in
                                   range(len(getattr(self.engine, "replicas", [self.engine])))))
        except Exception:  # noqa: BLE001 - the server stays not-ready; the reason is logged
            logger.exception("warm-up generation failed; the server is not ready")
            return
        self.ready = True
        tune_gc_for_serving()  # the API process's start-up heap, as the engine's (host_gc.py)
        logger.info("ready: serving %s (context length %d, %d KV blocks of %d tokens)",
                    self.model_name, self.info.max_model_len, self.info.num_blocks,
                    self.info.block_size)

    async def _warm_up_one(self) -> None:
        token_id = self.info.model_config.bos_token_id or 0
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        request = GenerateRequest(f"warmup-{uuid.uuid4().hex}", [token_id], params,
                                  record_metrics=False)
        streams = await self.engine_client.generate([request], bypass_limits=True)
        while not streams[0].finished:
            await streams[0].next()

    def on_engine_dead(self, exc: BaseException) -> None:
        """Called on the event loop once the engine's front has failed every request."""
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
        await self._wait_idle(timeout)
        if self.active_requests > 0:
            logger.warning("shutdown timeout: aborting %d requests", self.active_requests)
            self.engine_client.abort_all("the server is shutting down")
            await self._wait_idle(FLUSH_GRACE_S)
        if self.request_exit is not None:
            self.request_exit()

    async def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.active_requests > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # ---- request checks ---------------------------------------------------------------------------

    def check_accepting(self) -> None:
        if self.draining:
            raise server_error("the server is shutting down", 503, "shutting_down")
        if self.engine_client.is_dead:
            raise server_error("the engine failed; the server takes no new requests", 503,
                               "engine_error")

    def check_model(self, model: str) -> None:
        self.lora_of(model)

    def lora_of(self, model: str):
        """The LoRARequest a request's `model` names, None for the base model; 404 for neither."""
        if model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise p.RequestError(f"The model `{model[:100]}` does not exist; this server "
                                 f"serves `{self.model_name}`", param="model", status=404,
                                 code="model_not_found")
        return lora

    def log_ignored(self, request: p.OpenAIModel, request_id: str = "-") -> None:
        names = p.ignored_fields(request)
        if names:
            shown = [name[:40] for name in names[:10]]
            logger.warning("request %s: ignoring unknown request fields: %s", request_id,
                           ", ".join(shown))
