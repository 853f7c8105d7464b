"""Prometheus metrics, under vLLM's names, so dashboards built for vLLM work unchanged.

Names, types, label names (model_name, engine) and histogram buckets follow
vLLM v1's PrometheusStatLogger; with data-parallel replicas (rooflm/dp/) each
replica writes its own `engine` series, as each of vLLM's DP engines does.
prometheus_client appends `_total` to counter names on exposition, so the
counter "vllm:prompt_tokens" is scraped as vllm:prompt_tokens_total, exactly
as from vLLM.

rooflm adds its own under the `rooflm:` prefix: the step time, the achieved
fractions of the memory-bandwidth and compute rooflines per step (MBU, MFU, from
the one step-cost model of perf/live.StepMeter, the same as the log line's), and
the KV pool's free and total block counts (a read-only way to see that no blocks leak).

Each app gets its own CollectorRegistry, so several servers (or tests) can live
in one process without colliding in the global registry.

The engine thread (or, with the engine in its own process, the event loop as the
engine's messages arrive) writes these, the HTTP side reads them: prometheus_client's
metrics take a lock per update, so that is safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rooflm.server.buckets import INTER_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS, STEP_TIME_BUCKETS, TTFT_BUCKETS

if TYPE_CHECKING:
    from rooflm.perf.live import StepStats


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for per-request token counts
    (prompt, generation, max_tokens), bounded by the context length."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


# vLLM's FinishReason values, plus "error" for requests the engine failed.
FINISHED_REASONS = ("stop", "length", "abort", "error")

LABEL_NAMES = ["model_name", "engine"]


def family_unlabelled(metrics: "ServerMetrics", cls, name: str, doc: str, labels: tuple):
    """A family without the model_name/engine labels (vLLM's own for a few info gauges),
    shared by every engine's view of the registry."""
    if name not in metrics._families:
        metrics._families[name] = cls(name, doc, list(labels), registry=metrics.registry)
    return metrics._families[name]


class ServerMetrics:
    """One engine's series (engine="0"); for_engine(i) gives another engine's, in the same
    registry, as vLLM labels its data-parallel engine cores."""

    def __init__(self, model_name: str, engine_index: str = "0", max_model_len: int = 2048,
                 _shared: Optional["ServerMetrics"] = None):
        # vLLM disables the *_created series; dashboards never use them. This is
        # a process-wide switch of prometheus_client.
        prometheus_client.disable_created_metrics()
        self.model_name, self.max_model_len = model_name, max_model_len
        self.registry = _shared.registry if _shared else CollectorRegistry(auto_describe=True)
        # name -> metric family, shared by every engine's view of this registry
        self._families: dict = _shared._families if _shared else {}
        labels = (model_name, engine_index)

        def family(cls, name: str, doc: str, extra_labels: tuple = (), **kwargs):
            if name not in self._families:
                self._families[name] = cls(name, doc, LABEL_NAMES + list(extra_labels),
                                           registry=self.registry, **kwargs)
            return self._families[name]

        def gauge(name: str, doc: str) -> Gauge:
            return family(Gauge, name, doc).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return family(Counter, name, doc).labels(*labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return family(Histogram, name, doc, buckets=buckets).labels(*labels)

        # Scheduler state.
        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # The same hits by where their blocks were: the device pool, or the host tier
        # (--kv-offload-gb), whose blocks are copied back instead of recomputed.
        hits_by_tier = family(Counter, "rooflm:prefix_cache_hits_by_tier",
                              "Prefix cache hits in tokens, by the tier that held their blocks.", ("tier",))
        self.prefix_cache_hits_by_tier = {tier: hits_by_tier.labels(*labels, tier) for tier in ("device", "host")}
        self.kv_offload_used_blocks = gauge("rooflm:kv_offload_used_blocks",
                                            "Blocks of the prefix cache's host tier holding a cached prefix.")
        self.kv_offload_blocks = counter("rooflm:kv_offload_blocks",
                                         "KV blocks copied from the GPU into the host tier on eviction.")
        self.kv_restore_blocks = counter("rooflm:kv_restore_blocks",
                                         "KV blocks copied back from the host tier on a prefix hit.")
        self._seen_offload = (0, 0)
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemption from the engine.")

        # Tokens and requests.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = family(Counter, "vllm:request_success",
                         "Count of successfully processed requests.", ("finished_reason",))
        self.request_success = {reason: success.labels(*labels, reason)
                                for reason in FINISHED_REASONS}

        # Latencies.
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)

        # Per finished request, as vLLM's dashboard reads them: prefill is first scheduled to
        # first token, decode is first token to last; the token counts use 1-2-5 buckets up to
        # the context length.
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of generation tokens over a request's samples.",
            token_buckets)
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)

        # rooflm's own.
        self.step_time = histogram("rooflm:step_time_seconds",
                                   "Wall time of one engine step in seconds.", STEP_TIME_BUCKETS)
        # Labelled only on first use: with unknown peaks the series are absent, not a
        # misleading 0.
        self._mbu_family = family(Gauge, "rooflm:mbu", "Achieved fraction of the memory-"
                                  "bandwidth roofline in the last step (bytes moved / step time "
                                  "/ peak bandwidth).")
        self._mfu_family = family(Gauge, "rooflm:mfu", "Achieved fraction of the compute "
                                  "roofline in the last step (FLOPs / step time / peak FLOP/s "
                                  "of the linear layers' format).")
        self._labels = labels
        self.kv_free_blocks = gauge("rooflm:kv_free_blocks",
                                    "KV-cache blocks free (cached prefixes count as free).")
        self.kv_num_blocks = gauge("rooflm:kv_num_blocks", "KV-cache blocks in the pool.")
        self.tokens_in_flight = gauge("rooflm:tokens_in_flight",
                                      "Tokens reserved by admitted requests (prompt + n * "
                                      "max_tokens), the quantity --max-tokens-in-flight caps.")
        # Service levels (docs/serving.md): the signal an autoscaler scales on, and what
        # SLO-aware admission refused.
        self.predicted_wait = gauge("rooflm:predicted_queue_wait_seconds",
                                    "Seconds a request arriving now is predicted to wait before "
                                    "its first step, from the engine's measured step costs.")
        self.shed_requests = counter("rooflm:shed_requests",
                                     "Requests refused with 503 before any prefill because their "
                                     "predicted time to first token exceeded their TTFT budget "
                                     "(--ttft-slo-ms or deadline_ms).")
        self.is_sleeping = gauge("rooflm:is_sleeping",
                                 "1 while the engine sleeps (sleep mode), else 0.")

        # Speculative decoding, under vLLM's names (absent-valued zeros without it).
        self.spec_decode_num_drafts = counter("vllm:spec_decode_num_drafts",
                                              "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                                    "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.")
        self._spec_per_pos = family(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft's position in speculative sequence.",
                                    ("position",))
        self.spec_decode_draft_time = counter("rooflm:spec_decode_draft_seconds",
                                              "Host seconds spent proposing draft tokens.")
        self.spec_decode_verify_time = counter("rooflm:spec_decode_verify_seconds",
                                               "Seconds of steps that verified draft tokens.")

        # --enable-lora. vLLM's info gauge: labels only (no model_name, engine), the adapters of
        # the running and waiting requests comma-joined, its value the wall-clock time of the
        # update (gateways read the newest series). Only the current series is kept.
        self._lora_info = family_unlabelled(self, Gauge, "vllm:lora_requests_info",
                                            "Running stats on lora requests.",
                                            ("max_lora", "waiting_lora_adapters", "running_lora_adapters"))
        lora_counts = {"rooflm:lora_requests": (Counter, "LoRA requests admitted, by adapter."),
                       "rooflm:lora_requests_running": (Gauge, "Requests running, by LoRA adapter."),
                       "rooflm:lora_requests_waiting": (Gauge, "Requests waiting, by LoRA adapter.")}
        self._lora_families = {name: family(cls, name, doc, ("lora_name",))
                               for name, (cls, doc) in lora_counts.items()}
        self._lora_names: set[str] = set()  # adapters with a running/waiting series

    def for_engine(self, engine_index: str) -> "ServerMetrics":
        """The series of another engine core (a data-parallel replica) in this registry."""
        return ServerMetrics(self.model_name, engine_index, self.max_model_len, _shared=self)

    # ---- written by the engine's front end --------------------------------------------------------

    def add_spec_decode(self, drafts: int, draft_tokens: int, accepted: int,
                        accepted_per_pos: list[int], draft_s: float, verify_s: float) -> None:
        """What speculative decoding did since the previous call."""
        for counter, value in ((self.spec_decode_num_drafts, drafts),
                               (self.spec_decode_num_draft_tokens, draft_tokens),
                               (self.spec_decode_num_accepted_tokens, accepted),
                               (self.spec_decode_draft_time, draft_s),
                               (self.spec_decode_verify_time, verify_s)):
            if value > 0:
                counter.inc(value)
        for position, value in enumerate(accepted_per_pos):
            if value > 0:
                self._spec_per_pos.labels(*self._labels, str(position)).inc(value)

    def set_scheduler_state(self, running: int, waiting: int, kv_usage: float, free_blocks: int,
                            num_blocks: int) -> None:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage.set(kv_usage)
        self.kv_free_blocks.set(free_blocks)
        self.kv_num_blocks.set(num_blocks)

    def set_tokens_in_flight(self, tokens: int) -> None:
        self.tokens_in_flight.set(tokens)

    def set_service_state(self, predicted_wait_s: float, is_sleeping: bool) -> None:
        self.predicted_wait.set(predicted_wait_s)
        self.is_sleeping.set(1 if is_sleeping else 0)

    def observe_shed(self) -> None:
        self.shed_requests.inc()

    def add_prefix_cache(self, queries: int, hits: int, host_hits: int = 0) -> None:
        """Tokens looked up and found since the last call; host_hits: of the hits, those
        restored from the host tier."""
        if queries > 0:
            self.prefix_cache_queries.inc(queries)
        if hits > 0:
            self.prefix_cache_hits.inc(hits)
        if hits - host_hits > 0:
            self.prefix_cache_hits_by_tier["device"].inc(hits - host_hits)
        if host_hits > 0:
            self.prefix_cache_hits_by_tier["host"].inc(host_hits)

    def set_kv_offload_state(self, used_blocks: int, offloaded: int, restored: int) -> None:
        """The host tier now: blocks in use, and blocks copied in and back since start."""
        self.kv_offload_used_blocks.set(used_blocks)
        seen_offloaded, seen_restored = self._seen_offload
        if offloaded > seen_offloaded:
            self.kv_offload_blocks.inc(offloaded - seen_offloaded)
        if restored > seen_restored:
            self.kv_restore_blocks.inc(restored - seen_restored)
        self._seen_offload = (max(offloaded, seen_offloaded), max(restored, seen_restored))

    def add_preemptions(self, count: int) -> None:
        if count > 0:
            self.num_preemptions.inc(count)

    def add_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        if prompt_tokens > 0:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens > 0:
            self.generation_tokens.inc(generation_tokens)

    def observe_first_token(self, ttft_seconds: float) -> None:
        self.time_to_first_token.observe(ttft_seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def observe_finished(self, reason: str, e2e_seconds: Optional[float],
                         queue_seconds: Optional[float]) -> None:
        counter = self.request_success.get(reason)
        if counter is not None:
            counter.inc()
        if e2e_seconds is not None:
            self.e2e_request_latency.observe(e2e_seconds)
        if queue_seconds is not None:
            self.request_queue_time.observe(queue_seconds)

    def observe_request(self, prompt_tokens: int, sample_tokens: list[int],
                        prefill_seconds: Optional[float], decode_seconds: Optional[float]) -> None:
        """A request that finished (stop or length): its prompt, the tokens each of its n samples
        generated, and its prefill and decode times (None: not observed).

        request_generation_tokens counts all n samples; request_max_num_generation_tokens is the
        longest sample, as vLLM records it for a parallel-sampling request (for n = 1 the two agree).
        """
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(sum(sample_tokens))
        self.request_max_num_generation_tokens.observe(max(sample_tokens, default=0))
        if prefill_seconds is not None:
            self.request_prefill_time.observe(max(prefill_seconds, 0.0))
        if decode_seconds is not None:
            self.request_decode_time.observe(max(decode_seconds, 0.0))

    def set_lora_state(self, max_loras: int, running: dict[str, int], waiting: dict[str, int],
                       added_requests: dict[str, int]) -> None:
        """The adapters' queues now (name -> requests) and the requests admitted per adapter
        since the previous call."""
        self._lora_info.clear()
        self._lora_info.labels(str(max_loras), ",".join(sorted(waiting)),
                               ",".join(sorted(running))).set(time.time())
        families = self._lora_families
        for name, n in added_requests.items():
            families["rooflm:lora_requests"].labels(*self._labels, name).inc(n)
        self._lora_names |= set(running) | set(waiting)
        for name in self._lora_names:  # an adapter whose queue emptied reads 0, not its last count
            families["rooflm:lora_requests_running"].labels(*self._labels, name).set(running.get(name, 0))
            families["rooflm:lora_requests_waiting"].labels(*self._labels, name).set(waiting.get(name, 0))

    def record_step(self, stats: "StepStats") -> None:
        """One step as the StepMeter costed it: its time, and its MBU and MFU where the
        device's peaks are known (None: the gauge is left unset, not set to a made-up number).
        """
        self.step_time.observe(stats.elapsed_s)
        if stats.elapsed_s <= 0:
            return  # no rate to speak of
        if stats.mbu is not None:
            self._mbu_family.labels(*self._labels).set(stats.mbu)
        if stats.mfu is not None:
            self._mfu_family.labels(*self._labels).set(stats.mfu)

    # ---- read by the HTTP side ------------------------------------------------------------------

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)

    content_type = prometheus_client.CONTENT_TYPE_LATEST
