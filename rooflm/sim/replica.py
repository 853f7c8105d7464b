"""One simulated engine: the engine's own scheduler, block manager and output processor,
with a step-cost model in place of the model runner.

Nothing of the scheduling is re-implemented here. A SimReplica builds the real
engine.scheduler.Scheduler over a real engine.block_manager.BlockManager and hands each
step's results to the real engine.output_processor.OutputProcessor (no tokenizer), exactly
as LLMEngine does; only the model runner is replaced: a step takes the time the cost model
gives its BatchShape, and its "sampled" tokens are a filler id, or EOS where the workload
says the request stops early. `step_call` mirrors LLMEngine.step(), sync and async:

  sync   schedule step t, run it, process its tokens;
  async  schedule step t and queue it behind step t-1 on the device, then wait for step
         t-1's tokens and process them (the host's work overlaps the device's, and a new
         request reaches the scheduler only at the next call);
  pipeline parallelism with N batches in flight (engine/step_strategy.PipelineStep): schedule
         a batch of requests no batch in flight holds, launch it, and process the oldest once
         N are in flight. A batch takes its step's time from launch to tokens (every stage in
         turn), but stage 0 takes the next one after 1 / stages of it: the stages work on
         different batches at once.

What the real engine does around that (validation in add_request, max_tokens resolution,
the KV-fits check) is called through the same functions the engine calls.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from rooflm.config import SchedulerConfig
from rooflm.engine.block_manager import BlockManager
from rooflm.engine.model_runner import StepResult
from rooflm.engine.output_processor import OutputProcessor
from rooflm.engine.report import BatchShape, StepReport, StepTimings, batch_shape
from rooflm.engine.request import Request, RequestStatus
from rooflm.engine.scheduler import Scheduler, SchedulerOutput
from rooflm.engine.step_cost import StepCostEstimator, predict_ttft
from rooflm.errors import InvalidRequest
from rooflm.sampling_params import SamplingParams, resolve_max_tokens
from rooflm.sim.api_process import ApiProcess
from rooflm.sim.cost_model import StepCostModel

# Token ids the simulated sampler emits: any id works (the scheduler never reads them), but
# the filler must not be the EOS id, and generated blocks are hashed into the prefix cache.
FILLER_TOKEN = 1
EOS_TOKEN = 0


@dataclass(frozen=True)
class ReplicaConfig:
    """The engine options a replica runs with: the scheduler's and the KV pool's."""

    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0
    max_model_len: int = 4096
    async_scheduling: bool = True
    sliding_window: Optional[int] = None
    # KV cache groups' windows (engine/kv_groups.py), group 0 full: num_blocks are then blocks of
    # the group size's layers, and sliding groups hold only their window, as in the engine.
    kv_windows: tuple[Optional[int], ...] = (None,)
    # The prefix cache's host tier (engine/host_kv_tier.py): the real block manager's, so hits
    # and evictions are the engine's. Each block copied between host and device (tier
    # restores and offloads, swaps) adds host_copy_s_per_block to its step: the copies run on
    # the step's stream, before its forward.
    num_offload_blocks: int = 0
    host_copy_s_per_block: float = 0.0
    # Pipeline parallelism: its stages, and the batches in flight (ParallelConfig.batches_in_flight).
    pipeline_stages: int = 1
    micro_batches: int = 1
    # SLO-aware admission (--ttft-slo-ms): a request whose predicted time to first token, by the
    # engine's own predictor over the engine's own step-cost averages fed with the simulated
    # steps, exceeds the budget is refused on delivery (RequestRecord.error starts "shed").
    ttft_slo_ms: float = 0.0


@dataclass
class RequestRecord:
    """What one request went through, in simulated seconds."""

    request_id: str
    arrival_s: float  # when the client sent it
    prompt_len: int
    output_len: int  # tokens the workload says it generates
    replica: int = 0
    delivered_s: Optional[float] = None  # when the engine could first schedule it
    scheduled_s: Optional[float] = None  # first scheduled: the end of its queueing
    token_times: list[float] = field(default_factory=list)  # when each token reached the client
    admitted_s: Optional[float] = None  # when the API process took it in (the server's arrival stamp)
    first_token_server_s: Optional[float] = None  # when the API process took in the first token's step
    finish_s: Optional[float] = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    error: str = ""


@dataclass
class _Launched:
    out: SchedulerOutput
    shape: BatchShape
    end_s: float


@dataclass(frozen=True)
class StepSample:
    """One launched step, for the result's KV-usage-over-time series."""

    start_s: float
    end_s: float
    shape: BatchShape
    kv_usage: float
    num_running: int
    num_waiting: int
    num_preempted: int


class SimReplica:
    def __init__(self, cfg: ReplicaConfig, cost_model: StepCostModel, index: int = 0,
                 record_steps: bool = True, api: Optional[ApiProcess] = None):
        self.cfg = cfg
        self.api = api  # streams the tokens to clients; None: they arrive at the step's end
        self.index = index
        self.cost_model = cost_model
        self.block_manager = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          cfg.num_host_blocks, windows=cfg.kv_windows,
                                          num_offload_blocks=cfg.num_offload_blocks)
        self.scheduler = Scheduler(cfg.scheduler, self.block_manager)
        self.outputs = OutputProcessor(self.scheduler, None, {EOS_TOKEN}, cfg.max_model_len,
                                       itertools.count())
        self.records: dict[str, RequestRecord] = {}
        self._requests: dict[str, Request] = {}
        self._stop_at: dict[str, int] = {}  # request id -> output length where EOS is sampled
        self.in_flight: Optional[_Launched] = None
        self.pipeline: deque[_Launched] = deque()  # batches in flight, oldest first (micro_batches > 1)
        if cfg.micro_batches > 1:
            self.scheduler.use_micro_batches(cfg.micro_batches)
        self.device_free_s = 0.0
        self.num_steps = 0
        self.busy_s = 0.0
        self.record_steps = record_steps
        self.steps: list[StepSample] = []
        self.finished: list[RequestRecord] = []
        self._outstanding_tokens = 0  # prompt + output tokens of unfinished requests (router load)
        self.step_cost = StepCostEstimator()  # what SLO-aware admission predicts from

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, record: RequestRecord, token_ids: list[int], max_tokens: int,
                    stops_early: bool, priority: int = 0, now: Optional[float] = None) -> bool:
        """Queue a request as LLMEngine.add_request does (the same max_tokens resolution and
        KV-fits check). A request the engine would reject, or SLO-aware admission would shed
        (at `now`, its delivery), is finished with its error."""
        record.replica = self.index
        if self.cfg.ttft_slo_ms and now is not None and self._sheds(record, len(token_ids), priority, now):
            return False
        try:
            resolved = resolve_max_tokens(max_tokens, len(token_ids), self.cfg.max_model_len)
            need = self.block_manager.blocks_for_request(len(token_ids), resolved)
            if need > self.block_manager.num_blocks:
                raise InvalidRequest(f"request needs up to {need} KV-cache blocks but the cache has "
                                     f"{self.block_manager.num_blocks}", param="max_tokens")
        except InvalidRequest as exc:
            record.error = str(exc)
            self.finished.append(record)
            return False
        params = SamplingParams(max_tokens=resolved, temperature=0.0, ignore_eos=not stops_early,
                                output_kind="final")
        req = Request(record.request_id, None, token_ids, params, resolved,
                      arrival_time=record.arrival_s, priority=priority)
        req.seqs.append(self.outputs.new_seq(req, 0, list(token_ids)))
        self.scheduler.add(req)
        self.records[record.request_id] = record
        self._requests[record.request_id] = req
        if stops_early:
            self._stop_at[record.request_id] = record.output_len
        self._outstanding_tokens += len(token_ids) + record.output_len
        return True

    def _sheds(self, record: RequestRecord, prompt_len: int, priority: int, now: float) -> bool:
        """serving_loop.slo_check's rule. The engine checks a request where its loop takes it in,
        just before scheduling it, with the step in flight ahead of it; delivered mid-step here,
        the request has the launched work ahead of it, known exactly (device_free_s)."""
        launched = max(self.device_free_s - now, 0.0) if self.step_cost.measured else 0.0
        wait = launched + predict_ttft(self.scheduler, self.step_cost, prompt_len, priority, record.arrival_s)
        waited = now - record.arrival_s
        if waited + wait <= self.cfg.ttft_slo_ms / 1e3:
            return False
        record.error = f"shed: predicted time to first token {1e3 * (waited + wait):.0f} ms"
        self.finished.append(record)
        return True

    # ---- load, for routers ---------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.records)

    @property
    def outstanding_tokens(self) -> int:
        return self._outstanding_tokens

    def kv_usage(self) -> float:
        return self.block_manager.usage()

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None or bool(self.pipeline)

    # ---- the step ----------------------------------------------------------------------------

    def step_call(self, now: float) -> Optional[float]:
        """One LLMEngine.step() call at host time `now`. Returns when the host is free for the
        next call, or None when the replica is idle (nothing scheduled, nothing in flight)."""
        out = self.scheduler.schedule()
        launched = None
        if not out.is_empty:
            launched = self._launch(out, now)
        if self.cfg.micro_batches > 1:
            return self._pipelined(launched, now)
        if not self.cfg.async_scheduling:
            if launched is None:
                return None
            self._process(launched)
            return launched.end_s
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:
            self._process(previous)
            return max(now, previous.end_s)
        return now if launched is not None else None

    def _pipelined(self, launched: Optional[_Launched], now: float) -> Optional[float]:
        """step_call's end with batches in flight: the oldest is processed once the pipeline is
        full, or when nothing more could be scheduled."""
        if launched is not None:
            self.pipeline.append(launched)
        if self.pipeline and (launched is None or len(self.pipeline) >= self.cfg.micro_batches):
            oldest = self.pipeline.popleft()
            self._process(oldest)
            return max(now, oldest.end_s)
        return now if launched is not None else None

    def _launch(self, out: SchedulerOutput, now: float) -> _Launched:
        shape = batch_shape(out, self.cfg.sliding_window)
        start = max(now, self.device_free_s)
        seconds = self.cost_model.step_seconds(shape, len(out.scheduled))
        seconds += (len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out)) * self.cfg.host_copy_s_per_block
        end = start + seconds
        if self.cfg.micro_batches > 1:
            seconds /= self.cfg.pipeline_stages  # stage 0 is free for the next batch (equal stages)
        self.device_free_s = start + seconds
        self.step_cost.observe(StepReport(self.num_steps + 1, shape, len(out.scheduled), len(out.preempted),
                                          "sim", StepTimings(elapsed_s=end - start)))
        self.num_steps += 1
        self.busy_s += seconds
        for sch in out.scheduled:
            record = self.records[sch.request.request_id]
            if record.scheduled_s is None:
                record.scheduled_s = now
        if self.record_steps:
            self.steps.append(StepSample(start, end, shape, self.block_manager.usage(),
                                         len(self.scheduler.running), len(self.scheduler.waiting),
                                         len(out.preempted)))
        return _Launched(out, shape, end)

    def _process(self, step: _Launched) -> None:
        """The step's tokens reach the host at its end: the real output processor applies them."""
        sampled: dict[int, list[int]] = {}
        t = step.end_s
        got: list[RequestRecord] = []
        for sch in step.out.scheduled:
            seq, req = sch.seq, sch.request
            if not sch.completes or seq.finished or req.status == RequestStatus.FINISHED:
                continue
            stop_at = self._stop_at.get(req.request_id)
            eos = stop_at is not None and seq.num_output_tokens + 1 == stop_at
            sampled[seq.seq_id] = [EOS_TOKEN if eos else FILLER_TOKEN]
            got.append(self.records[req.request_id])
        # When each token reaches its client: the step's end, or later behind the API process.
        times = self.api.send(t, len(got)) if self.api is not None else [t] * len(got)
        # The API process reads the step's results when it gets to them, then streams them.
        taken = times[0] - self.api.cost.token_s if self.api is not None and times else t
        for record, at in zip(got, times):
            if record.first_token_server_s is None:
                record.first_token_server_s = taken
            record.token_times.append(at)
        for output in self.outputs.process(step.out, StepResult(sampled, {}, {})):
            if output.finished:
                record = self.records[output.request_id]
                self._finish(output.request_id, output.num_cached_tokens,
                             record.token_times[-1] if record.token_times else t)

    def _finish(self, request_id: str, num_cached: int, t: float) -> None:
        record = self.records.pop(request_id)
        record.finish_s = t
        record.num_cached_tokens = num_cached
        record.num_preemptions = self._requests.pop(request_id).num_preemptions
        self._stop_at.pop(request_id, None)
        self._outstanding_tokens -= record.prompt_len + record.output_len
        self.finished.append(record)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
