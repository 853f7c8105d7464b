"""The synchronous engine: add_request / step / abort_request.

A step is: schedule -> run the model and sample -> process outputs (append
tokens, detokenize, check stop conditions, free finished sequences' blocks).
Servers and benchmarks drive it; LLM.generate is a loop over step().
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

import torch

from rooflm.config import EngineConfig
from rooflm.engine.block_manager import BlockManager
from rooflm.engine.model_runner import ModelRunner, StepHandle, StepResult
from rooflm.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from rooflm.engine.report import (NULL_TRACER, BatchShape, EngineInfo, EngineSnapshot, PhaseTracer,
                                  StepReport, StepTimings, batch_shape)
from rooflm.engine.request import Request, RequestStatus, Sequence
from rooflm.engine.scheduler import Scheduler, SchedulerOutput
from rooflm.errors import InvalidRequest
from rooflm.sampling_params import SamplingParams, resolve_max_tokens

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int]]


@dataclass
class _InFlight:
    """A launched step, until its results are processed."""

    out: SchedulerOutput
    handle: StepHandle
    shape: BatchShape
    index: int
    schedule_s: float
    launch_s: float
    launched_at: float


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from rooflm.model.loader import load_model_config, resolve_model

        t0 = time.perf_counter()
        self.config = config
        self.model_path, self.load_format = resolve_model(config.load.model, config.load.load_format)
        self.model_config = load_model_config(self.model_path, self.load_format)
        self.tokenizer = self._load_tokenizer()
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        self.runner.load_model(self.model_path, self.load_format)
        num_blocks = self.runner.determine_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs()
        num_host = self.runner.num_host_blocks()
        self.runner.allocate_host_cache(num_host)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching, num_host)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.async_scheduling = config.runtime.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.runner.device.type == "cuda"
        self._in_flight: Optional[_InFlight] = None  # launched, not yet processed
        self._last_collect = time.perf_counter()
        self._observers: list[Callable[[StepReport], None]] = []
        self.tracer: PhaseTracer = NULL_TRACER
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._seq_ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.startup_s = time.perf_counter() - t0
        self.info = self._make_info()
        logger.info("ready in %.1f s (%s)", self.startup_s,
                    ", ".join(f"{k} {v:.1f} s" for k, v in self.runner.timings.items()))

    def _make_info(self) -> EngineInfo:
        cfg = self.config
        return EngineInfo(
            model=str(cfg.load.model or "default"), model_config=self.model_config,
            max_model_len=self.max_model_len, block_size=self.block_manager.block_size,
            num_blocks=self.block_manager.num_blocks, num_host_blocks=self.block_manager.num_host_blocks,
            max_num_seqs=cfg.scheduler.max_num_seqs, max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            device=str(self.runner.device), dtype=str(self.runner.dtype).replace("torch.", ""),
            weight_dtype_bytes=self.runner.dtype.itemsize, kv_dtype_bytes=self.runner.kv_dtype.itemsize,
            async_scheduling=self.async_scheduling, has_tokenizer=self.tokenizer is not None,
            startup_s=self.startup_s)

    # ---- the read-only face ------------------------------------------------------------------

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
            prefix_hit_tokens=bm.prefix_hits, prompt_tokens=self.stats["prompt_tokens"],
            generation_tokens=self.stats["generation_tokens"], steps=self.stats["steps"])

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
        from rooflm.tokenizer.tokenizer import Tokenizer, has_tokenizer_files
        source = self.config.load.tokenizer
        if source is not None:
            fmt = "gguf" if source.endswith(".gguf") else "safetensors"
            return Tokenizer.load(source, fmt)
        if self.load_format == "dummy":
            return None  # prompts must be token ids
        if self.load_format == "safetensors" and not has_tokenizer_files(self.model_path):
            logger.warning("%s has no tokenizer files: prompts must be token ids", self.model_path)
            return None
        return Tokenizer.load(self.model_path, self.load_format)

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
                    arrival_time: Optional[float] = None, cache_salt: Optional[str] = None) -> Request:
        """Validate and queue a request. Raises InvalidRequest (a ValueError naming the request
        field at fault), changing nothing, on bad input; ValueError on a caller's bug (a
        request id in use, params of the wrong type)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        max_tokens = self._resolve_max_tokens(len(token_ids), params)
        self._check_fits(len(token_ids), max_tokens, params.n)
        for t in params.stop_token_ids or ():
            if t >= self.model_config.vocab_size:
                raise InvalidRequest(f"stop_token_ids contains {t}, outside the vocabulary [0, "
                                     f"{self.model_config.vocab_size})", param="stop_token_ids")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        req = Request(request_id, text, token_ids, params, max_tokens, cache_salt=cache_salt,
                      arrival_time=arrival_time or time.monotonic(), generator=generator)
        req.seqs.append(self._new_seq(req, 0, list(token_ids)))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.stats["prompt_tokens"] += len(token_ids)
        return req

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        return resolve_max_tokens(params.max_tokens, prompt_len, self.max_model_len)

    def _check_fits(self, prompt_len: int, max_tokens: int, n: int) -> None:
        bm = self.block_manager
        prompt_blocks = prompt_len // bm.block_size
        need = prompt_blocks + n * (bm.blocks_needed(prompt_len + max_tokens) - prompt_blocks)
        if need > bm.num_blocks:
            # max_tokens: the field a client can always lower to fit (the prompt fits the context).
            raise InvalidRequest(f"request needs up to {need} KV-cache blocks (prompt {prompt_len} + "
                                 f"max_tokens {max_tokens}, n={n}) but the cache has {bm.num_blocks}",
                                 param="max_tokens")

    def _new_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), index, token_ids, len(req.prompt_token_ids))
        self._init_text_state(req, seq)
        return seq

    def _init_text_state(self, req: Request, seq: Sequence) -> None:
        from rooflm.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer.hf, req.prompt_token_ids,
                                                     req.params.skip_special_tokens)
        if req.params.stop:
            seq.stop_matcher = StopStringMatcher(req.params.stop, req.params.include_stop_str_in_output)

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
            outputs.append(self._make_output(req, {}))
        return outputs

    @property
    def num_steps(self) -> int:
        """Steps launched since start."""
        return self.stats["steps"]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step. With async scheduling (CUDA), step t+1 is scheduled and queued on
        the GPU before step t's tokens are read back, so host work overlaps device work and
        the outputs returned are those of the previous step."""
        t0 = time.perf_counter()
        with self.tracer.phase("schedule"):
            out = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if not out.is_empty:
            shape = batch_shape(out, self.model_config.sliding_window)
            prev = self._in_flight.handle if self._in_flight is not None else None
            with self.tracer.phase("launch"):
                handle = self.runner.launch(out, self._suppressed_tokens(out), prev)
            self.stats["steps"] += 1
            launched = _InFlight(out, handle, shape, self.stats["steps"], t1 - t0,
                                 time.perf_counter() - t1, t1)
        if not self.async_scheduling:
            return self._finish_step(launched) if launched is not None else []
        previous, self._in_flight = self._in_flight, launched
        return self._finish_step(previous) if previous is not None else []

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight, if any (async scheduling), and return its outputs; after
        it nothing is queued on the device, so async scheduling can be switched."""
        step, self._in_flight = self._in_flight, None
        return self._finish_step(step) if step is not None else []

    def _finish_step(self, step: "_InFlight") -> list[RequestOutput]:
        """Read a launched step's samples back, process them, and report the step."""
        t0 = time.perf_counter()
        with self.tracer.phase("collect"):
            result = self.runner.collect(step.handle)
        t1 = time.perf_counter()
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
                num_preempted=len(step.out.preempted), cuda_graph=step.handle.cuda_graph,
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
            # Tokens generated before this sample: those read back plus earlier pending ones.
            generated = sch.seq.num_output_tokens + sch.seq.num_pending - 1
            if params.min_tokens and sch.completes and generated < params.min_tokens:
                ids = set(params.stop_token_ids or ())
                if not params.ignore_eos:
                    ids |= self.eos_token_ids
                suppress[sch.seq.seq_id] = tuple(sorted(ids))
        return suppress

    def _process(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        deltas: dict[str, dict[int, tuple[list[int], str]]] = {}
        touched: dict[str, Request] = {}
        for sch in out.scheduled:
            seq, req = sch.seq, sch.request
            if seq.finished or req.request_id not in self.requests:
                continue  # finished (or aborted) while this step was in flight: drop its token
            completes = sch.completes
            if seq.seq_id in result.prompt_logprobs:
                req.prompt_logprobs.extend(self._decode_logprobs(e) for e in result.prompt_logprobs[seq.seq_id])
            if seq.block_table and req.status == RequestStatus.RUNNING:
                # Only blocks whose token ids are all known can be hashed.
                known = min(seq.num_computed_tokens, seq.num_known_tokens)
                seq.num_cached_blocks = self.block_manager.cache_full_blocks(
                    seq.token_ids, seq.block_table, known, req.cache_salt, seq.num_cached_blocks)
            if completes:
                tokens = result.sampled[seq.seq_id]
                lps = result.logprobs.get(seq.seq_id, [None] * len(tokens))
                targets = self._fork(req, seq) if req.needs_fork else [seq]
                for target, token, lp in zip(targets, tokens, lps):
                    delta = self._append_token(req, target, token, lp)
                    d = deltas.setdefault(req.request_id, {})
                    d[target.index] = delta
                req.first_token_time = req.first_token_time or now
                req.last_token_time = now
                touched[req.request_id] = req
        outputs = []
        for rid, req in touched.items():
            if req.finished:
                self.scheduler.finish(req)
                self.requests.pop(rid, None)
            outputs.append(self._make_output(req, deltas.get(rid, {})))
        return outputs

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        """The prompt is done: the request becomes n sequences sharing its blocks."""
        seqs = [parent]
        for i in range(1, req.params.n):
            child = self._new_seq(req, i, list(parent.token_ids))
            child.output_token_ids = list(parent.output_token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_table = self.block_manager.fork(parent.block_table)
            child.num_cached_blocks = parent.num_cached_blocks
            seqs.append(child)
        req.seqs = seqs
        req.forked = True
        return seqs

    def _decode_logprobs(self, entry: Optional[dict]) -> Optional[dict]:
        if entry is None:
            return None
        return {tid: TokenLogprob(lp, rank, self._token_text(tid)) for tid, (lp, rank) in entry.items()}

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _append_token(self, req: Request, seq: Sequence, token: int, lp: Optional[dict]):
        params = req.params
        seq.append_token(token)
        self.stats["generation_tokens"] += 1
        if lp is not None:
            seq.output_logprobs.append(self._decode_logprobs(lp))
        text = seq.detokenizer.step([token]) if seq.detokenizer is not None else ""
        n_out = seq.num_output_tokens
        past_min = n_out >= params.min_tokens
        stop_str = None
        if seq.stop_matcher is not None:
            text, stop_str = seq.stop_matcher.feed(text)
        if stop_str is not None and past_min:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif params.stop_token_ids and token in params.stop_token_ids and past_min:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos and past_min:
            seq.finish_reason = "stop"
        elif n_out >= req.max_tokens or seq.num_known_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finished:
            text += self._flush_text(seq, stopped_by_string=stop_str is not None)
            self.scheduler.free_seq(req, seq)
        seq.output_text += text
        return [token], text

    @staticmethod
    def _flush_text(seq: Sequence, stopped_by_string: bool) -> str:
        if stopped_by_string:
            return ""
        tail = seq.detokenizer.flush() if seq.detokenizer is not None else ""
        if seq.stop_matcher is not None:
            text, _ = seq.stop_matcher.feed(tail)
            return text + seq.stop_matcher.flush()
        return tail

    def _make_output(self, req: Request, deltas: dict[int, tuple[list[int], str]]) -> RequestOutput:
        completions = []
        delta_text, delta_ids = [], []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            completions.append(CompletionOutput(
                # The live list, not a copy: copying every step would cost O(length^2).
                index=seq.index, text=seq.output_text, token_ids=seq.output_token_ids,
                logprobs=seq.output_logprobs if req.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            ids, text = deltas.get(seq.index, ([], ""))
            delta_ids.append(ids)
            delta_text.append(text)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=completions, finished=req.finished, prompt_logprobs=req.prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens, delta_text=delta_text, delta_token_ids=delta_ids)
