"""Speculative decoding's step strategies (engine/step_strategy.py): how it plugs into the step.

SpecHostStep, the host path (decoder.py): before scheduling, the decoder decides how many drafts
the next step verifies (k) and gives out the draft slots; a step that speculates needs every
sequence's tokens on the host, so the step in flight is finished first. After scheduling the
proposer fills the slots. A step with drafts to verify runs synchronously (its accepted lengths
decide the next schedule); plain steps keep async scheduling.

SpecLoopStep, the device loop (loop.py), where it runs (with CUDA graphs by default, also eagerly
with speculative_device_loop=True; never with a draft model or tensor parallelism): while the
running batch fits the loop, step t + 1 is queued before step t is finished, as async scheduling
does for plain steps; otherwise the step is the host path's.
"""

from __future__ import annotations

import time
from typing import Optional

from rooflm.engine.cuda_graph import capture_sizes
from rooflm.engine.model_runner import StepResult
from rooflm.engine.report import SpecSnapshot
from rooflm.engine.step_strategy import InFlightStep, StepStrategy
from rooflm.spec.decoder import SpecDecoder
from rooflm.spec.loop import LoopStep, SpecLoop


class SpecHostStep(StepStrategy):
    def __init__(self, decoder: SpecDecoder):
        self.decoder = decoder

    def kv_bytes_per_block(self) -> int:
        return self.decoder.proposer.kv_bytes_per_block()

    def attach(self, engine) -> StepStrategy:
        super().attach(engine)
        self.decoder.proposer.allocate(engine.block_manager.num_blocks)
        loop = self._make_loop(engine)
        return SpecLoopStep(self, loop) if loop is not None else self

    @staticmethod
    def _make_loop(engine) -> Optional[SpecLoop]:
        """The device loop where it runs; its graphs are captured now, in the decode graphs'
        memory pool."""
        config, runner = engine.config, engine.runner
        cfg = config.speculative
        graphs = runner.graphs
        if (cfg.speculative_device_loop is False or cfg.speculative_method == "draft"
                or runner.tp.size > 1 or (cfg.speculative_device_loop is None and graphs is None)):
            return None
        loop = SpecLoop(runner, cfg.num_speculative_tokens, cfg.speculative_max_batch_tokens,
                        config.scheduler.max_num_seqs, engine.max_model_len)
        if graphs is not None:
            t0 = time.perf_counter()
            loop.capture(capture_sizes(min(loop.max_batch, config.runtime.cuda_graph_max_batch)), graphs.pool)
            runner.timings["spec_loop_capture_s"] = time.perf_counter() - t0
        return loop

    def step(self, t0: float, outputs: list) -> list:
        with self.engine.tracer.phase("plan"):
            k = self.decoder.decide(self.engine.scheduler)
        return self.step_with(t0, outputs, k)

    def step_with(self, t0: float, outputs: list, k: int) -> list:
        """The host path's step once the decoder decided k (> 0: it speculates)."""
        engine, decoder = self.engine, self.decoder
        with engine.tracer.phase("plan"):
            if k:  # proposals read every sequence's tokens on the host
                outputs = outputs + engine.drain()
            decoder.assign(engine.scheduler, k)
        with engine.tracer.phase("schedule"):
            out = engine.scheduler.schedule()
        if not out.is_empty:
            with engine.tracer.phase("propose"):
                decoder.propose(out, engine.scheduler)
        launched = engine.launch(out, t0, speculating=k > 0)
        # A verify step's accepted lengths decide the next schedule: it runs synchronously (the
        # step before it was drained above).
        if not engine.async_scheduling or decoder.verifies(out):
            return engine.finish_now(launched, outputs)
        return engine.overlap(launched, outputs)

    def observe_result(self, step: InFlightStep, result: StepResult, collected_at: float) -> None:
        self.decoder.observe(step.out, result.sampled, collected_at - step.launched_at, step.planned_at,
                             step.behind or not self.engine.async_scheduling, step.speculating)

    def spec_snapshot(self) -> Optional[SpecSnapshot]:
        return self.decoder.stats.snapshot()


class SpecLoopStep(StepStrategy):
    """The device loop while the running batch fits it; the host path's step otherwise. The
    loop ends when a step cannot follow: the last step in flight is finished, spare blocks go
    back, and the next step is the host path's."""

    def __init__(self, host: SpecHostStep, loop: SpecLoop):
        self.host, self.loop = host, loop
        self.decoder = host.decoder
        self.engine = host.engine

    def step(self, t0: float, outputs: list) -> list:
        engine, loop = self.engine, self.loop
        with engine.tracer.phase("plan"):
            k = self.decoder.decide(engine.scheduler)
        if loop.active_loop or loop.wants(engine.scheduler, k, self.decoder.proposer):
            ran, outputs = self._loop_step(t0, k, outputs)
            if ran:
                return outputs
        return self.host.step_with(t0, outputs, k)

    def _loop_step(self, t0: float, k: int, outputs: list) -> tuple[bool, list]:
        """Queue loop step t + 1, then finish step t. Entering drains the step in flight;
        (False, outputs) when the batch could not enter after all, or the loop could not even
        start (the pool too short for its look-ahead): the host path runs this step, and
        preempts if it must."""
        engine, loop = self.engine, self.loop
        if not loop.active_loop:
            outputs = outputs + engine.drain()
            if not loop.enter(engine.scheduler, self.decoder.proposer):
                return False, outputs
        launched = None
        t1 = time.perf_counter()
        if loop.can_continue(engine.scheduler, k):
            with engine.tracer.phase("launch"):
                handle = loop.launch(engine.scheduler)
            if handle is not None:
                # The shape is known once the step's drafts are (collect).
                launched = InFlightStep(handle.out, handle, None, engine.count_step(), t1 - t0,
                                        time.perf_counter() - t1, t1, t0, True, True, collector=self)
        if launched is None:
            loop.release_lookahead()
        ran = launched is not None or engine.has_step_in_flight
        outputs = engine.overlap(launched, outputs)
        if launched is None:
            loop.exit(engine.scheduler)
        return ran, outputs

    def collect(self, handle: LoopStep, wait_device: bool = False) -> StepResult:
        """A loop step's tokens, as the runner's collect gives a step's (no logprobs)."""
        return StepResult(self.loop.collect(handle), {}, {})

    def observe_result(self, step: InFlightStep, result: StepResult, collected_at: float) -> None:
        self.host.observe_result(step, result, collected_at)

    def spec_snapshot(self) -> Optional[SpecSnapshot]:
        return self.host.spec_snapshot()
