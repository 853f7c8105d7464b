"""The synchronous engine: add_request / step / abort_request.

A step is: schedule -> run the model and sample -> process outputs (append
tokens, detokenize, check stop conditions, free finished sequences' blocks).
How a step is planned is the attached step strategy's (engine/step_strategy.py): plain
steps, or speculative decoding's. Servers and benchmarks drive it; LLM.generate is a loop
over step().
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Callable, Iterable, Optional, Union

import torch

from rooflm.config import CUDA_BLOCK_SIZE, EngineConfig, ModelConfig, with_device_defaults
from rooflm.distributed.group import SINGLE
from rooflm.engine.block_manager import BlockManager
from rooflm.engine.host_gc import tune_gc_for_serving
from rooflm.layers import kv_cache as kv_format
from rooflm.engine.model_runner import ModelRunner, StepHandle, StepResult, resolve_device
from rooflm.engine.output_processor import OutputProcessor
from rooflm.engine.outputs import RequestOutput
from rooflm.engine.report import (NULL_TRACER, EngineInfo, EngineSnapshot, ExpertLoad, LoRASnapshot, PhaseTracer,
                                  StepReport, StepTimings, batch_shape)
from rooflm.engine.request import Request, RequestStatus, Sequence
from rooflm.engine.scheduler import Scheduler, SchedulerOutput
from rooflm.engine.step_cost import StepCostEstimator, predict_queue_wait, predict_ttft
from rooflm.engine.step_strategy import InFlightStep, PipelineStep, PlainStep, StepStrategy
from rooflm.kernels.fa4_prefill import fa4_block_size
from rooflm.errors import InvalidRequest
from rooflm.sampling_params import SamplingParams, resolve_max_tokens

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int]]


def strategy_for(config: EngineConfig, target: ModelConfig, max_model_len: int) -> StepStrategy:
    """The strategy an engine config asks for, before the engine's parts exist.

    The engine's one import of a package above it (spec plugs into the engine). LLMEngine is
    built in the engine's own core process (engine/core.py) as well as by LLM, the server, the
    CLI and benchmarks, so no single builder above the engine could attach speculative decoding
    for all of them; the engine asks spec's factory here instead, only when the config asks."""
    if config.parallel.batches_in_flight > 1:
        return PipelineStep(config.parallel.batches_in_flight)
    if not config.speculative.speculative_method:
        return PlainStep()
    from rooflm.spec.factory import speculative_strategy
    return speculative_strategy(config, target, max_model_len)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from rooflm.model.loader import load_model_config, resolve_model

        t0 = time.perf_counter()
        device = resolve_device(config.device.device)
        memory_gb = torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None
        config = with_device_defaults(config, device.type, fa4_block_size(config, device) or CUDA_BLOCK_SIZE,
                                      memory_gb)
        self.config = config
        if config.runtime.enable_sleep_mode and config.speculative.speculative_method:
            # A draft model's weights and pool, and the device loop's graphs, would stay.
            raise ValueError("--enable-sleep-mode does not run with speculative decoding yet")
        if config.lora.enable_lora and config.runtime.enable_sleep_mode:
            raise ValueError("--enable-lora does not run with --enable-sleep-mode yet (the slots would be lost)")
        self.model_path, self.load_format = resolve_model(
            config.load.model, config.load.load_format, revision=config.load.revision,
            download_dir=config.load.download_dir)
        self.model_config = load_model_config(self.model_path, self.load_format)
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        # Tensor parallelism: the executor checks the size, starts ranks 1..N-1 and this process
        # joins as rank 0 (under torchrun, ranks > 0 become workers here).
        self.executor = None
        tp = stage = world = None
        if config.parallel.tensor_parallel_size > 1 or config.parallel.pipeline_parallel_size > 1:
            self.executor = self._start_workers()
            tp, stage, world = self.executor.tp, self.executor.stage, self.executor.world
        self.tokenizer = self._load_tokenizer()
        self.runner = ModelRunner(config, self.model_config, self.max_model_len, tp or SINGLE, stage, world)
        if self.executor is not None:  # NCCL waits on graphs that captured it: they go first
            self.executor.release_before_shutdown(self.runner.release_graphs)
        self.strategy: StepStrategy = strategy_for(config, self.model_config, self.max_model_len)
        self.runner.extra_kv_bytes_per_block = self.strategy.kv_bytes_per_block()
        try:
            num_blocks, num_host, num_offload = self.runner.initialize(self.model_path, self.load_format)
        except BaseException:
            if self.executor is not None:  # workers waiting in a start-up collective
                try:  # a worker that raised first is the cause: WorkerDied with its traceback
                    self.executor.check_alive(grace_s=3.0)
                finally:
                    self.executor.shutdown(clean=False)
            raise
        self.block_manager = BlockManager(num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching, num_host,
                                          windows=self.runner.kv_layout.windows,
                                          num_offload_blocks=num_offload)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        if config.lora.enable_lora:
            self.scheduler.max_loras = config.lora.max_loras
        self.async_scheduling = config.runtime.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.runner.device.type == "cuda"
        self._in_flight: Optional[InFlightStep] = None  # launched, not yet processed
        # Pipeline parallelism's batches in flight, oldest first (step_strategy.PipelineStep).
        self.pipeline: collections.deque[InFlightStep] = collections.deque()
        self._last_collect = time.perf_counter()
        self._observers: list[Callable[[StepReport], None]] = []
        self.tracer: PhaseTracer = NULL_TRACER
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.output_processor = OutputProcessor(self.scheduler, self.tokenizer, self.eos_token_ids,
                                                self.max_model_len, itertools.count())
        self._num_prompt_tokens = 0
        self._lora_requests: dict[str, int] = {}  # adapter name -> requests admitted since start
        self._num_steps = 0
        self.strategy = self.strategy.attach(self)
        self._observe_result = self.strategy.observe_result
        self._grammar_compiler = None  # structured.compiler.GrammarCompiler, at first use
        self._compiling: list[Request] = []  # requests whose grammar has not compiled yet
        self.startup_s = time.perf_counter() - t0
        self.info = self._make_info()
        # The engine's own step costs, measured as it runs (step_cost.py): SLO-aware admission
        # and the predicted-wait gauge read them.
        self.step_cost = StepCostEstimator()
        self._observers.append(self.step_cost.observe)
        self._wait_gauge = (-1, -1, 0.0)  # (steps, waiting) it was computed at, seconds
        self._sleep_level: Optional[int] = None
        self.last_wake_phases: Optional[dict] = None  # the last wake_up's WakePhases.as_dict()
        self._woke_at: Optional[float] = None  # perf_counter of the last wake_up, until its first step
        if config.runtime.tune_gc:
            tune_gc_for_serving()
        logger.info("ready in %.1f s (%s)", self.startup_s,
                    ", ".join(f"{k} {v:.1f} s" for k, v in self.runner.timings.items()))

    def _start_workers(self):
        from rooflm.engine.executor import TPExecutor
        if self.config.parallel.pipeline_parallel_size > 1:
            self._check_pipeline_features()
        if self.config.runtime.enable_sleep_mode:  # the workers' weights and pools would stay
            raise ValueError("--enable-sleep-mode does not run with tensor_parallel_size > 1 yet")
        if self.config.speculative.speculative_method:
            raise ValueError("speculative decoding does not run with tensor_parallel_size > 1 yet")
        if self.config.runtime.deterministic:  # the parallel layers' matmuls are not the batch-invariant one
            raise ValueError("--deterministic does not run with tensor_parallel_size > 1 yet")
        return TPExecutor.start(self.config, self.model_config, self.max_model_len,
                                self.model_path, self.load_format)

    def _check_pipeline_features(self) -> None:
        """What does not compose with --pipeline-parallel-size yet, named by its flag."""
        cfg = self.config
        refused = [flag for flag, on in (
            ("--speculative-method", cfg.speculative.speculative_method),
            ("--enable-lora", cfg.lora.enable_lora),
            ("--enable-sleep-mode", cfg.runtime.enable_sleep_mode),
            ("--deterministic", cfg.runtime.deterministic)) if on]
        if refused:
            raise ValueError(f"{', '.join(refused)} does not run with --pipeline-parallel-size > 1 yet")

    def check_alive(self) -> None:
        """Raise if part of the engine is gone (a tensor-parallel worker that died)."""
        if self.executor is not None:
            self.executor.check_alive()

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if it has any (tensor or pipeline parallelism)."""
        if self.executor is not None:
            if self.pipeline:  # batches in flight: their transfers end before the groups do
                try:
                    self.drain()
                except Exception as exc:  # noqa: BLE001 - a broken group: the shutdown below terminates
                    logger.warning("batches in flight at shutdown were not finished: %s", exc)
                    self.pipeline.clear()
            self.executor.shutdown()

    def _make_info(self) -> EngineInfo:
        cfg = self.config
        return EngineInfo(
            model=str(cfg.load.model or "default"), model_config=self.model_config,
            max_model_len=self.max_model_len, block_size=self.block_manager.block_size,
            num_blocks=self.block_manager.num_blocks, num_host_blocks=self.block_manager.num_host_blocks,
            max_num_seqs=cfg.scheduler.max_num_seqs, max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            device=str(self.runner.device), dtype=str(self.runner.dtype).replace("torch.", ""),
            weight_dtype_bytes=self.runner.linear_bytes_per_weight(),
            kv_dtype_bytes=self.runner.kv_bytes_per_element(),
            async_scheduling=self.async_scheduling, has_tokenizer=self.tokenizer is not None,
            startup_s=self.startup_s, act_dtype_bytes=self.runner.dtype.itemsize,
            head_dtype_bytes=self.runner.head_bytes_per_weight(),
            kv_cache_dtype=kv_format.parse_kv_cache_dtype(cfg.cache.kv_cache_dtype),
            tensor_parallel_size=cfg.parallel.tensor_parallel_size,
            matmul_dtype=self.runner.matmul_dtype(),
            enable_sleep_mode=cfg.runtime.enable_sleep_mode,
            num_offload_blocks=self.block_manager.host_tier.num_blocks if self.block_manager.host_tier is not None else 0)

    # ---- the read-only face ------------------------------------------------------------------

    @property
    def spec(self):
        """Speculative decoding's SpecDecoder (spec/decoder.py), None without: tests and
        benchmarks swap its proposer and read its policy."""
        return self.strategy.decoder

    @property
    def spec_loop(self):
        """Speculative decoding's device loop (spec/loop.py), None where it does not run."""
        return self.strategy.loop

    @property
    def model(self):
        """The loaded model (torch.nn.Module): for offline tools that hook or read its layers
        (rooflm/quant/: calibration, quantized checkpoints), not for serving."""
        return self.runner.model

    def snapshot(self) -> EngineSnapshot:
        """The queues and the KV pool now."""
        sched, bm = self.scheduler, self.block_manager
        running = [seq for req in sched.running for seq in req.live_seqs]
        return EngineSnapshot(
            num_running_reqs=len(sched.running), num_waiting_reqs=len(sched.waiting),
            num_swapped_reqs=len(sched.swapped), num_running_seqs=len(running),
            num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
            running_context_tokens=sum(s.num_computed_tokens for s in running),
            num_preemptions=sched.num_preemptions, prefix_queried_tokens=bm.prefix_queries,
            prefix_hit_tokens=bm.prefix_hits, prompt_tokens=self._num_prompt_tokens,
            generation_tokens=self.output_processor.num_generated_tokens, steps=self._num_steps,
            kv_admission_stalls=sched.num_kv_stalls, spec=self.strategy.spec_snapshot(),
            predicted_wait_s=self._predicted_wait_gauge(), is_sleeping=self.is_sleeping,
            prefix_host_hit_tokens=bm.prefix_host_hits, lora=self._lora_snapshot(),
            **_tier_counts(bm.host_tier))

    def expert_load(self, steps: int) -> Optional[ExpertLoad]:
        """Tokens routed to each expert over the last `steps` steps (at most the counter's
        history); None unless the engine counts (count_expert_load) and the model has MoE
        layers. Reads the device: call it between steps. Under tensor parallelism the driver's
        count is every rank's: the router is replicated."""
        counter = self.runner.expert_load
        if counter is None:
            return None
        counts = counter.recent(steps).tolist()
        parallel = self.config.parallel
        return ExpertLoad(layers=tuple(counter.names), num_experts=counter.num_experts,
                          top_k=self.model_config.num_experts_per_tok,
                          ep_ranks=parallel.tensor_parallel_size if parallel.enable_expert_parallel else 1,
                          steps_begun=counter.steps,
                          counts=tuple(tuple(tuple(layer) for layer in step) for step in counts))

    def _lora_snapshot(self) -> Optional[LoRASnapshot]:
        """The adapters of the running and waiting requests, by name (None: LoRA off)."""
        if self.runner.lora is None:
            return None

        def by_adapter(requests) -> tuple[tuple[str, int], ...]:
            counts: dict[str, int] = {}
            for req in requests:
                if req.lora_request is not None:
                    name = req.lora_request.lora_name
                    counts[name] = counts.get(name, 0) + 1
            return tuple(sorted(counts.items()))

        sched = self.scheduler
        return LoRASnapshot(max_loras=self.config.lora.max_loras, running=by_adapter(sched.running),
                            waiting=by_adapter(list(sched.waiting) + list(sched.swapped)),
                            requests=tuple(sorted(self._lora_requests.items())))

    def predicted_queue_wait(self, priority: int = 0, arrival: Optional[float] = None) -> float:
        """Seconds a request of this priority, arriving at `arrival` (monotonic; None: now),
        is predicted to wait before its first step (step_cost.py)."""
        arrival = time.monotonic() if arrival is None else arrival
        return predict_queue_wait(self.scheduler, self.step_cost, priority, arrival)

    def predicted_ttft(self, prompt_tokens: int, priority: int = 0, arrival: Optional[float] = None) -> float:
        """Seconds from now to the first token of a request of prompt_tokens tokens, admitted now
        (step_cost.predict_ttft): what SLO-aware admission weighs against a TTFT budget."""
        arrival = time.monotonic() if arrival is None else arrival
        in_flight = self.async_scheduling and self.has_step_in_flight()
        return predict_ttft(self.scheduler, self.step_cost, prompt_tokens, priority, arrival, in_flight)

    def _predicted_wait_gauge(self) -> float:
        """predicted_queue_wait() for a default request, recomputed when the queue changed or
        every few steps: the snapshot is taken every step, and the capacity-bound estimate
        reads every running request."""
        steps, waiting, value = self._wait_gauge
        num_waiting = len(self.scheduler.waiting)
        if num_waiting != waiting or self._num_steps - steps >= 8:
            value = self.predicted_queue_wait() if num_waiting else 0.0
            self._wait_gauge = (self._num_steps, num_waiting, value)
        return value

    def add_observer(self, observer: Callable[[StepReport], None]) -> None:
        """Call observer(report) after each executed step, on the engine's thread. Observers
        must be quick and must not call back into the engine."""
        self._observers.append(observer)

    def remove_observer(self, observer: Callable[[StepReport], None]) -> None:
        self._observers.remove(observer)

    def set_tracer(self, tracer: Optional[PhaseTracer]) -> None:
        """Name the phases of each step (the profiler's hook); None restores the no-op."""
        self.tracer = tracer or NULL_TRACER
        self.runner.tracer = self.tracer

    @classmethod
    def from_kwargs(cls, **kwargs) -> "LLMEngine":
        from rooflm.config import engine_config_from_kwargs
        return cls(engine_config_from_kwargs(**kwargs))

    def _load_tokenizer(self):
        from rooflm.tokenizer.tokenizer import load_model_tokenizer
        t0 = time.perf_counter()
        tokenizer = load_model_tokenizer(self.config.load.tokenizer, self.model_path, self.load_format,
                                         download_dir=self.config.load.download_dir)
        if tokenizer is not None:  # from a GGUF file this takes seconds: say where they went
            logger.info("tokenizer loaded in %.1f s", time.perf_counter() - t0)
        return tokenizer

    # ---- requests --------------------------------------------------------------------

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer (dummy weights): pass token ids, "
                                     "or give a tokenizer", param="prompt")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got "
                                 f"{type(prompt).__name__}", param="prompt")
        if not prompt:
            raise InvalidRequest("prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequest(f"prompt token id at index {i} is {t!r}; token ids must be "
                                     f"integers in [0, {vocab})", param="prompt")
        return None, list(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, cache_salt: Optional[str] = None,
                    priority: int = 0, lora_request=None) -> Request:
        """Validate and queue a request. Raises InvalidRequest (a ValueError naming the request
        field at fault), changing nothing, on bad input; ValueError on a caller's bug (a
        request id in use, params of the wrong type); RuntimeError while the engine sleeps.

        priority: under --scheduling-policy priority, lower values go first (vLLM's rule);
        under fcfs only 0 is accepted, as vLLM refuses a priority it would not honour."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if self._sleep_level is not None:
            raise RuntimeError("the engine is sleeping: wake_up() first")
        self.check_priority(priority)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        self._check_fits(len(token_ids), max_tokens, params.n)
        for t in params.stop_token_ids or ():
            if t >= self.model_config.vocab_size:
                raise InvalidRequest(f"stop_token_ids contains {t}, outside the vocabulary [0, "
                                     f"{self.model_config.vocab_size})", param="stop_token_ids")
        for t in params.logit_bias or ():
            if t >= self.model_config.vocab_size:
                raise InvalidRequest(f"logit_bias has token id {t}, outside the vocabulary [0, "
                                     f"{self.model_config.vocab_size})", param="logit_bias")
        self._check_lora(lora_request)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._compile_grammar(params)
        generators = []
        if params.seed is not None:
            # One generator per sample, seeded seed + index as vLLM seeds its n child requests:
            # a sample's draws never depend on how long its siblings run (under async
            # scheduling a finished sample is sampled once more, and that draw is its own).
            generators = [torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
                          for i in range(params.n)]
        req = Request(request_id, text, token_ids, params, max_tokens, cache_salt=cache_salt,
                      arrival_time=arrival_time or time.monotonic(), generators=generators,
                      priority=priority)
        req.grammar = grammar
        req.lora_request = lora_request
        if lora_request is not None:
            name = lora_request.lora_name
            self._lora_requests[name] = self._lora_requests.get(name, 0) + 1
        if grammar is not None:
            self._compiling.append(req)
        req.seqs.append(self._new_seq(req, 0, list(token_ids)))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.requests[request_id] = req
        self.scheduler.add(req)
        self._num_prompt_tokens += len(token_ids)
        return req

    def _check_lora(self, lora_request) -> None:
        """A request's adapter (rooflm.lora.LoRARequest) read into the host cache now, so a bad
        one is refused before anything is queued (InvalidRequest on the `model` field)."""
        if lora_request is None:
            return
        from rooflm.lora.adapter import LoRAAdapterError
        from rooflm.lora.request import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            raise ValueError("lora_request must be a rooflm.lora.LoRARequest")
        if self.runner.lora is None:
            raise InvalidRequest(f"LoRA adapter {lora_request.lora_name!r} requested, but the engine runs "
                                 f"without --enable-lora", param="model")
        try:
            self.runner.lora.load(lora_request)
        except LoRAAdapterError as e:
            raise InvalidRequest(str(e), param="model") from e

    def check_priority(self, priority) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequest(f"priority must be an integer, got {type(priority).__name__}",
                                 param="priority")
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise InvalidRequest(f"got priority {priority} but priority scheduling is not enabled "
                                 f"(--scheduling-policy priority)", param="priority")

    def _compile_grammar(self, params: SamplingParams):
        """Start compiling a request's grammar on the compiler's worker thread; returns at once."""
        if self.tokenizer is None:
            raise InvalidRequest("structured outputs need the model's tokenizer, and this model "
                                 "has none (dummy weights)", param=params.structured_outputs.param)
        if self._grammar_compiler is None:
            from rooflm.structured.compiler import GrammarCompiler
            self._grammar_compiler = GrammarCompiler(self.tokenizer.hf, self.model_config.vocab_size,
                                                     sorted(self.eos_token_ids))
        return self._grammar_compiler.submit(params.structured_outputs)

    def _reap_failed_grammars(self) -> list[RequestOutput]:
        """Forget compiled grammars' requests; finish those whose grammar failed to compile
        (the API checks constraints before admission, so this is a backstop)."""
        outputs, still = [], []
        for req in self._compiling:
            if req.status == RequestStatus.FINISHED:
                continue
            # done first: a compile can finish between two reads, and a finished future
            # stays finished, so its error is then final.
            if not req.grammar.done:
                still.append(req)
                continue
            if req.grammar.error is None:
                continue
            logger.warning("request %s: grammar failed to compile: %s", req.request_id,
                           req.grammar.error)
            outputs.extend(self.abort_request(req.request_id))
        self._compiling = still
        return outputs

    def _sample_constrained(self, handle: StepHandle) -> None:
        """Fill the step's token bitmask from its sequences' grammar matchers (which have
        seen every token before this step) and sample under it."""
        from rooflm.structured.bitmask import allocate_bitmask
        from rooflm.structured.matcher import fill_bitmask

        owners = handle.inputs.row_owner
        bitmask = allocate_bitmask(len(owners), self.model_config.vocab_size)
        fills, copies, first_row = [], [], {}
        for r in handle.constrained_rows:
            seq = owners[r].seq
            if seq.seq_id in first_row:  # n rows of a forking prompt share its matcher
                copies.append((r, first_row[seq.seq_id]))
                continue
            first_row[seq.seq_id] = r
            if seq.grammar is None and not seq.finished:
                seq.grammar = owners[r].request.grammar.new_matcher()
            fills.append((r, seq.grammar))
        fill_bitmask(bitmask, fills)
        for r, source in copies:
            bitmask[r] = bitmask[source]
        self.runner.sample_constrained(handle, bitmask)

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        return resolve_max_tokens(params.max_tokens, prompt_len, self.max_model_len)

    def _check_fits(self, prompt_len: int, max_tokens: int, n: int) -> None:
        bm = self.block_manager
        need = bm.blocks_for_request(prompt_len, max_tokens, n)
        if need > bm.num_blocks:
            # max_tokens: the field a client can always lower to fit (the prompt fits the context).
            raise InvalidRequest(f"request needs up to {need} KV-cache blocks (prompt {prompt_len} + "
                                 f"max_tokens {max_tokens}, n={n}) but the cache has {bm.num_blocks}",
                                 param="max_tokens")

    def _new_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        return self.output_processor.new_seq(req, index, token_ids)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            for seq in req.seqs:
                if not seq.finished:
                    seq.finish_reason = "abort"
            self.scheduler.finish(req)
            outputs.append(self.output_processor.make_output(req, {}))
        return outputs

    @property
    def num_steps(self) -> int:
        """Steps launched since start."""
        return self._num_steps

    # ---- sleep mode (vLLM's) ---------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level is not None

    def sleep(self, level: int = 1) -> None:
        """Free the device: the KV pool always (its contents and the prefix cache are
        forgotten), and the weights, moved to host memory (level 1) or dropped (level 2: wake_up
        loads them again from the model source). On one GPU the weights and the pool live on
        regions whose physical memory is given back while their addresses stay reserved
        (engine/sleep_memory.py), so the CUDA graphs, which hold those addresses, survive level
        1; level 2, or a device without them, releases the graphs and wake_up captures them
        again. On the CPU the weights already live in host memory: level 1 keeps them, level 2
        drops them too.

        Every request must have finished or been aborted (the front ends abort theirs first);
        a step still in flight is finished. Sleeping again is a no-op."""
        self.check_sleep_level(level)
        if self._sleep_level is not None:
            return
        self.drain()
        if self.scheduler.has_unfinished():
            raise RuntimeError(f"cannot sleep with {len(self.requests)} unfinished requests: "
                               f"abort them first")
        self.block_manager.reset_prefix_cache()
        t0 = time.perf_counter()
        self.runner.sleep(level)
        self._sleep_level = level
        logger.info("sleeping (level %d) after %.2f s", level, time.perf_counter() - t0)

    def check_sleep_level(self, level) -> None:
        """Raise unless sleep(level) may run: sleep mode on, level 1 or 2."""
        if not self.config.runtime.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        if isinstance(level, bool) or level not in (1, 2):
            raise InvalidRequest(f"sleep level must be 1 or 2, got {level!r}", param="level")

    def wake_up(self) -> Optional[dict]:
        """Undo sleep(): the weights back on the device (or loaded again), the KV pool back, the
        CUDA graphs kept where their addresses are (level 1 on one GPU) or captured again.
        Returns the phases' seconds (weights, kv, graphs, total; sleep_memory.WakePhases), also
        logged on one line; None when the engine was awake (a no-op)."""
        if self._sleep_level is None:
            return None
        level = self._sleep_level
        phases = self.runner.wake_up(self.model_path, self.load_format)
        self._sleep_level = None
        self._woke_at = time.perf_counter()
        logger.info(phases.line(level))
        self.last_wake_phases = {"level": level, **phases.as_dict()}
        return self.last_wake_phases

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self.pipeline)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step. With async scheduling (CUDA), step t+1 is scheduled and queued on
        the GPU before step t's tokens are read back, so host work overlaps device work and
        the outputs returned are those of the previous step."""
        if self.executor is None:
            return self._step()
        try:
            return self._step()
        except Exception:
            # A collective that failed on a dead worker's sockets: name the worker instead.
            self.executor.check_alive(grace_s=5.0)
            raise

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.check_alive()
        failed = self._reap_failed_grammars() if self._compiling else []
        outputs = self.strategy.step(t0, failed)
        if self._woke_at is not None and outputs:
            # The rest of a wake-up's cost: what the first step after it paid (a kernel's
            # first launch, a graph captured lazily), next to the phases' line.
            logger.info("first step after wake_up: its outputs %.2f s after it", time.perf_counter() - self._woke_at)
            self._woke_at = None
        return outputs

    # ---- what step strategies run a step with (engine/step_strategy.py) ----------------------

    def launch(self, out: SchedulerOutput, t0: float, speculating: bool = False) -> Optional[InFlightStep]:
        """Queue a scheduled step on the model runner without waiting for it (None: nothing
        was scheduled). t0: when the step's _step began."""
        t1 = time.perf_counter()
        if out.is_empty:
            return None
        shape = batch_shape(out, self.model_config.sliding_window)
        prev = self._in_flight.handle if self._in_flight is not None else None
        with self.tracer.phase("launch"):
            handle = self.runner.launch(out, self._suppressed_tokens(out), prev)
        self._num_steps += 1
        return InFlightStep(out, handle, shape, self._num_steps, t1 - t0, time.perf_counter() - t1, t1, t0,
                            prev is not None, speculating)

    def count_step(self) -> int:
        """Count a step launched outside the model runner (speculative decoding's device
        loop); returns its index."""
        self._num_steps += 1
        return self._num_steps

    @property
    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None or bool(self.pipeline)

    def finish_now(self, launched: Optional[InFlightStep], outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Synchronous scheduling, or a step whose results decide the next schedule (a verify
        step): wait for the step just launched and process it, after `outputs`."""
        if launched is None:
            return outputs
        if launched.handle.needs_bitmask:
            self._sample_constrained(launched.handle)
        return outputs + self._finish_step(launched)

    def overlap(self, launched: Optional[InFlightStep], outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Async scheduling: the step just launched stays queued on the device while the one
        before it is finished; returns `outputs`, then that one's."""
        previous, self._in_flight = self._in_flight, launched
        finished = self._finish_step(previous) if previous is not None else []
        if launched is not None and launched.handle.needs_bitmask:
            # Structured outputs under async scheduling: step t+1's forward is already queued
            # behind step t; step t's tokens have just reached the matchers, so its mask can
            # be filled and its sampling queued. The device waits only if the host's output
            # processing and mask fill take longer than step t+1's forward.
            self._sample_constrained(launched.handle)
        return outputs + finished

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight, if any (async scheduling), and return its outputs; after
        it nothing is queued on the device, so async scheduling can be switched."""
        step, self._in_flight = self._in_flight, None
        outputs = self._finish_step(step) if step is not None else []
        while self.pipeline:
            outputs += self.finish_pipelined()
        return outputs

    def finish_pipelined(self) -> list[RequestOutput]:
        """Finish the oldest of pipeline parallelism's batches in flight and process it."""
        step = self.pipeline.popleft()
        self.runner.complete(step.handle)  # its rows back from the last stage, LM head, samples
        if step.handle.needs_bitmask:
            self._sample_constrained(step.handle)
        return self._finish_step(step)

    def _finish_step(self, step: InFlightStep) -> list[RequestOutput]:
        """Read a launched step's samples back, process them, and report the step."""
        t0 = time.perf_counter()
        with self.tracer.phase("collect"):
            result = (step.collector or self.runner).collect(step.handle, wait_device=self.async_scheduling)
            if step.shape is None:
                step.shape = batch_shape(step.out, self.model_config.sliding_window)
        t1 = time.perf_counter()
        if self._observe_result is not None:
            self._observe_result(step, result, t1)
        with self.tracer.phase("process"):
            outputs = self._process(step.out, result)
        t2 = time.perf_counter()
        # Sync: launch to results. Async: results to results, since the device ran this step
        # right after the previous one; never from before the step was launched (idle time).
        started = max(self._last_collect, step.launched_at) if self.async_scheduling else step.launched_at
        self._last_collect = t1
        if self._observers:
            report = StepReport(
                step=step.index, shape=step.shape, num_seqs=len(step.out.scheduled),
                num_preempted=len(step.out.preempted), graph=step.handle.graph,
                timings=StepTimings(schedule_s=step.schedule_s, launch_s=step.launch_s, wait_s=t1 - t0,
                                    process_s=t2 - t1, elapsed_s=t1 - started))
            for observer in self._observers:
                observer(report)
        return outputs

    def _suppressed_tokens(self, out: SchedulerOutput) -> dict[int, tuple[int, ...]]:
        """EOS and stop tokens are forbidden while a sequence is under its min_tokens."""
        suppress = {}
        for sch in out.scheduled:
            params = sch.request.params
            if not params.min_tokens or not sch.completes:
                continue  # most rows: nothing to count
            # Tokens generated before this sample: those read back plus earlier pending ones.
            generated = sch.seq.num_output_tokens + sch.seq.num_pending - 1
            if generated < params.min_tokens:
                ids = set(params.stop_token_ids or ())
                if not params.ignore_eos:
                    ids |= self.eos_token_ids
                suppress[sch.seq.seq_id] = tuple(sorted(ids))
        return suppress

    def _process(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Turn a step's results into outputs (engine/output_processor.py); forget the
        requests that finished."""
        outputs = self.output_processor.process(out, result)
        for output in outputs:
            if output.finished:
                self.requests.pop(output.request_id, None)
        return outputs


def _tier_counts(tier) -> dict[str, int]:
    """The host tier's part of the snapshot (zeros without one)."""
    if tier is None:
        return {}
    return dict(num_offload_used_blocks=tier.num_used, num_offloaded_blocks=tier.num_stored,
                num_restored_blocks=tier.num_restored)
