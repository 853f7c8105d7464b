"""The server's own flags (the engine's are EngineConfig's), and the name it serves the model under."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

# The default token budget: this many times the KV cache's capacity in tokens.
# Reservations assume every request runs to max_tokens, which few do.
DEFAULT_TOKENS_IN_FLIGHT_PER_KV_TOKEN = 8

# EngineInfo.model when no model was given: the default model (rooflm.model.loader).
DEFAULT_MODEL = "default"


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: Optional[str] = None  # None: derived from the model path
    api_key: Optional[str] = None
    allowed_origins: tuple[str, ...] = ()  # empty: CORS off
    max_queued_requests: int = 64
    max_tokens_in_flight: Optional[int] = None  # None: 8 x the KV cache's tokens; 0: no cap
    max_n: int = 16
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 * 1024
    request_timeout: float = 600.0  # seconds; 0: none
    # Slow clients (server/slow_clients.py): a request head or body that takes longer gets 408;
    # past max_reading_connections heads (or bodies) still arriving, new ones get 503. 0 s: none.
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    max_reading_connections: int = 256
    health_stall_seconds: float = 30.0
    # An engine core that dies is restarted (engine/core_client.py; the policy in engine/client.py), unless it died
    # engine_restart_max_deaths times within engine_restart_window_s: then it stays down.
    engine_restart: bool = True
    engine_restart_max_deaths: int = 5
    engine_restart_window_s: float = 60.0
    keep_running_on_error: bool = False
    shutdown_timeout: float = 30.0
    log_interval: float = 10.0  # seconds; 0: no periodic log line
    peak_bandwidth_gbs: float = 0.0  # 0: the GPU table's, if it knows the device
    warmup: bool = True
    chat_template: Optional[str] = None  # the template's text (--chat-template); None: the model's
    # The default of a chat request's split_special_tokens: message content as plain text.
    split_special_tokens: bool = False
    # One access log line per request (server/access_log.py); --disable-log-requests: off.
    log_requests: bool = True
    # Data parallelism (rooflm/dp/): this many engine cores, each on its own GPU or TP group,
    # and how a request picks one (cache_aware | round_robin | least_loaded).
    data_parallel_size: int = 1
    dp_routing: str = "cache_aware"
    # Where the replicas run: "mp" processes of this host, "ray" actors on a Ray cluster's nodes.
    data_parallel_backend: str = "mp"
    # Milliseconds: a request predicted to wait longer than this before its first step is
    # refused with 503 and Retry-After (its deadline_ms overrides); 0: no budget.
    ttft_slo_ms: float = 0.0
    # LoRA adapters served from start-up, "name=path" each (--lora-modules; needs --enable-lora).
    lora_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_n", "max_body_bytes", "max_header_bytes",
                     "max_reading_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout", "health_stall_seconds", "shutdown_timeout",
                     "log_interval", "peak_bandwidth_gbs", "ttft_slo_ms", "header_timeout_s",
                     "body_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.restart_policy()  # raises, naming what is wrong
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        from rooflm.config import require_placement_backend
        require_placement_backend(self.data_parallel_backend, "data_parallel_backend")
        from rooflm.dp.router import canonical_policy
        canonical_policy(self.dp_routing)  # raises, naming the policies
        if self.max_tokens_in_flight is not None and self.max_tokens_in_flight < 0:
            raise ValueError(f"max_tokens_in_flight must be >= 0, got {self.max_tokens_in_flight}")

    def restart_policy(self):
        """What an engine-core front end does when its core dies."""
        from rooflm.engine.client import RestartPolicy
        return RestartPolicy(self.engine_restart, self.engine_restart_max_deaths,
                             self.engine_restart_window_s)

    def tokens_in_flight_cap(self, kv_capacity_tokens: int) -> int:
        """The cap on tokens reserved by admitted requests; 0: none."""
        if self.max_tokens_in_flight is None:
            return DEFAULT_TOKENS_IN_FLIGHT_PER_KV_TOKEN * kv_capacity_tokens
        return self.max_tokens_in_flight


def derive_model_name(model: str) -> str:
    """The name /v1/models shows for a model as the engine was given it (EngineInfo.model):
    a preset name or a Hub repo id as given, else the file or folder name.

    GGUF files are named <model>.<quantization>.gguf; the quantization tag is
    not part of the model's name ("SmolLM2-135M-Instruct.Q4_1.gguf" ->
    "SmolLM2-135M-Instruct").
    """
    if model == DEFAULT_MODEL:
        from rooflm.model.loader import default_model_path
        model = default_model_path()
    from rooflm.model import hub
    if not os.path.exists(model) and hub.parse(model) is not None:
        return model  # a Hub repo id, as given (vLLM's default too): clients send it back
    name = os.path.basename(os.path.normpath(model))
    if name.lower().endswith(".gguf"):
        name = name[:-len(".gguf")]
        name = re.sub(r"[.-](I?Q\d[\w]*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)
    return name
